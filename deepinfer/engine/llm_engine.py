"""DeepInferenceEngine (alias LLM): the public Python API, offline (generate / chat) and streaming
(add_request / step / abort_request) for the server.

Start-up order names problems early: config and env -> config.json and model_type -> backend
and its capabilities -> tokenizer -> weights -> KV cache sized and allocated.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.parallel_setup import (
    abandon_job,
    agree_kv_budget,
    join_parallel_job,
    make_balancer,
    start_parallel_role,
)
from deepinfer.engine.request_intake import RequestIntake
from deepinfer.engine.startup import (
    attach_lower_tiers,
    attach_state_snapshots,
    cache_salt,
    check_backend,
    check_speculation,
    dtype_name,
    engine_kv_specs,
    freeze_startup_objects,
    generation_eos_ids,
    kv_budget_bytes,
    resolve_dtype,
    snapshot_bytes,
    use_async_scheduling,
    use_prefix_caching,
    window_rollback,
)
from deepinfer.engine.stats import EngineStats, merge_replica_stats
from deepinfer.errors import ConfigError, DeepInferError, InvalidRequestError
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.request import Request
from deepinfer.sched.step_pipeline import StepPipeline
from deepinfer.text.inputs import params_list, prompt_list

logger = logging.getLogger("deepinfer")


def _effective(config: EngineConfig) -> EngineConfig:
    """The settings an engine runs with: DEEPINFER_* applied, unbuilt features refused."""
    cfg = config.with_env()
    cfg.check_features_exist()
    return cfg


class DeepInferenceEngine(RequestIntake):
    """One model on one backend. `LLM(model=path, **config_fields)` works as well as from_config."""

    def __init__(self, config: EngineConfig | str | None = None, *, model: str | None = None, **kwargs: Any):
        if isinstance(config, EngineConfig):
            if model is not None or kwargs:
                raise ConfigError("pass either an EngineConfig or model=... with settings, not both")
        else:
            path = config if isinstance(config, str) else model  # None: the embedded model
            try:
                config = EngineConfig(model_name_or_path=path, **kwargs)
            except TypeError as exc:
                raise ConfigError(f"unknown engine setting: {exc}") from None
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "DeepInferenceEngine":
        return cls(config)

    # ------------------------------------------------------------ start-up

    def _start(self, config: EngineConfig) -> None:
        from deepinfer.backend.registry import default_registry, load_backend_class, requested_device
        from deepinfer.models.registry import config_dtype, load_hf_config, model_class_for

        cfg = _effective(config)
        path = cfg.model_name_or_path

        hf_config = load_hf_config(path)
        model_class_for(hf_config)  # UnsupportedModelError before any device work
        model_type = hf_config.get("model_type")
        from deepinfer.quant_config import parse_quant_config, resolve_linear_quant

        qfile = None if cfg.quantization_config is None else parse_quant_config(cfg.quantization_config)
        # flag + file + checkpoint format -> the load's settings and the scheme the backend must run (quant_config.py)
        quant_settings, ckpt_quant = resolve_linear_quant(cfg.quantization, qfile, hf_config)

        registry = default_registry()
        info = registry.resolve(requested_device(cfg.device))
        backend = load_backend_class(info)()
        dtype = resolve_dtype(cfg, config_dtype(hf_config), backend)
        check_backend(backend, cfg, dtype, ckpt_quant, model_type,
                      fuse_act_quant=quant_settings.fuse_act_quant is True,
                      moe_quantization=None if qfile is None else qfile.moe_scheme)
        check_speculation(cfg, backend, model_type, int(hf_config.get("num_nextn_predict_layers") or 0))
        job = join_parallel_job(cfg, backend, hf_config)  # None in one process; spawns / joins the other ranks
        try:
            self._build(cfg, path, hf_config, backend, dtype, quant_settings, job)
        except BaseException:
            if job is not None and not isinstance(sys.exc_info()[1], SystemExit):
                abandon_job(job)  # the spawned ranks fail the same way; do not leave them waiting
            raise

    def _build(self, cfg: EngineConfig, path: str, hf_config: dict, backend, dtype, quant_settings, job) -> None:
        from deepinfer.models.layers.quant import use_linear_quant
        from deepinfer.models.registry import load_model
        from deepinfer.text.tokenizer import Tokenizer

        if cfg.batch_invariant:
            backend.enable_batch_invariance()  # before the model asks the backend for its ops
        tokenizer = Tokenizer.from_pretrained(path)  # before the weights: a missing tokenizer fails fast
        with use_linear_quant(quant_settings):
            model = load_model(path, backend, dtype, progress=cfg.load_progress, hf_config=hf_config,  # parsed once
                               load_mtp=cfg.spec_method() == "mtp")
        self._init_runtime(cfg, backend, model, tokenizer, generation_eos_ids(path), job)
        if job is not None:
            start_parallel_role(self, job)  # a follower rank serves the leader here, then exits

    @classmethod
    def from_components(cls, config: EngineConfig, model, tokenizer, backend) -> "DeepInferenceEngine":
        """An engine around an already-built model and tokenizer (tests, embedding); same checks as from_config."""
        self = cls.__new__(cls)
        cfg = _effective(config)
        check_backend(backend, cfg, model.dtype, getattr(model, "quantization", None), getattr(model, "model_type", None))
        check_speculation(cfg, backend, getattr(model, "model_type", None), len(getattr(model, "mtp", ()) or ()))
        if cfg.batch_invariant and not backend.batch_invariance_enabled:
            raise ConfigError("EngineConfig.batch_invariant: this model's ops were made before "
                              "backend.enable_batch_invariance() was called; call it, then build the model")
        self._init_runtime(cfg, backend, model, tokenizer, set())
        return self

    def _init_runtime(self, cfg: EngineConfig, backend, model, tokenizer, eos_ids: set[int], job=None) -> None:
        """KV cache sizing and allocation, scheduler, runner, sampler, output processing."""
        from deepinfer.kv.manager import KVCacheManager
        from deepinfer.kv.planner import plan_kv_cache
        from deepinfer.sample.sampler import Sampler
        from deepinfer.sched.scheduler import Scheduler
        from deepinfer.text.output_processor import OutputProcessor
        from deepinfer.worker.decode_rows import short_extend_tokens
        from deepinfer.worker.model_runner import ModelRunner

        self.config = cfg
        self.backend = backend
        self.model = model
        block_size = cfg.block_size or backend.caps.kv_block_sizes[0]
        max_pos = int(model.max_position_embeddings)
        if cfg.max_model_len is not None and cfg.max_model_len > max_pos:
            raise ConfigError(
                f"EngineConfig.max_model_len={cfg.max_model_len} exceeds the model's "
                f"max_position_embeddings={max_pos}"
            )
        self._max_model_len = cfg.max_model_len or max_pos
        token_budget = cfg.token_budget(self._max_model_len)
        if not cfg.enable_chunked_prefill and token_budget < self._max_model_len:
            raise ConfigError(
                f"EngineConfig.max_num_batched_tokens={token_budget} is below max_model_len={self._max_model_len} "
                "with chunked prefill off: long prompts could never be scheduled"
            )

        from deepinfer.backend.kv_spec import KV_CACHE_DTYPES

        kv_dtype = KV_CACHE_DTYPES[cfg.kv_cache_storage()]  # None: the compute dtype (V4 refuses fp8 at check_backend)
        specs, state_rollback = engine_kv_specs(cfg, model, kv_dtype)
        layouts = {s.name: backend.kv_cache_layout(s) for s in specs}  # the backend says the shape
        self._kv_layouts = layouts
        prefix_caching = use_prefix_caching(cfg, specs, model)
        rollback = window_rollback(cfg, specs)
        plan = plan_kv_cache(
            specs,
            block_size,
            cfg.max_num_seqs,
            self._max_model_len,
            token_budget,
            budget_bytes=None if cfg.num_kv_blocks else agree_kv_budget(job, kv_budget_bytes(
                cfg, backend, model, block_size, token_budget, self._max_model_len, layouts)),
            num_kv_blocks=cfg.num_kv_blocks,
            layouts=layouts,
            snapshot_bytes_per_block=snapshot_bytes(specs, block_size, layouts) if prefix_caching else 0,
            window_rollback_tokens=rollback,
        )
        kv = KVCacheManager(specs, plan.num_blocks, block_size, cfg.max_num_seqs, self._max_model_len,
                            prefix_caching=prefix_caching, window_rollback_tokens=rollback,
                            state_rollback_tokens=state_rollback,
                            cache_salt=cache_salt(model, block_size, backend, cfg.kv_cache_storage())
                            if prefix_caching else b"")
        too_small = kv.fits_alone(self._max_model_len, token_budget)
        if too_small:
            raise ConfigError(
                f"the KV cache ({plan.capacity_tokens} tokens) cannot hold one sequence of max_model_len="
                f"{self._max_model_len}: " + "; ".join(too_small)
                + ". Raise kv_cache_memory_bytes / num_kv_blocks / gpu_memory_utilization or lower max_model_len"
            )
        self.kv = kv
        self.kv_plan = plan

        self._tokenizer = tokenizer
        eos_ids = set(eos_ids)
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.vocab_size = int(model.vocab_size)
        sampler = Sampler(self.vocab_size, eos_token_id=sorted(eos_ids), backend=backend)
        from deepinfer.sample.grammar.compiler import check_backend_available

        if cfg.structured_output_backend != "llguidance":  # an engine asked for by name must be there now
            check_backend_available(cfg.structured_output_backend)
        self._grammar_compiler = None  # built at the first structured request (sample/grammar/compiler.py)
        self._eos_ids = sorted(eos_ids)
        self.runner = ModelRunner(model, kv, plan.num_blocks, cfg.max_num_seqs, backend.device, sampler, layouts)
        if cfg.kv_disk_cache_dir is not None or cfg.kv_host_cache_gib is not None:
            attach_lower_tiers(cfg, kv, self.runner.caches)
        if kv.hybrid and kv.uses_state:
            attach_state_snapshots(kv, model, self.runner.caches, plan.num_blocks[kv.window_group])
        # EPLB installs its redundant expert slots before any graph is captured (deepinfer/parallel/eplb.py)
        self._balancer = make_balancer(cfg, model, backend, job)
        self.experts_moved = 0
        rows = cfg.max_num_seqs
        if cfg.spec_method():  # verify steps replay the decode graphs as decode rows (spec/verify_batch.py)
            from deepinfer.spec.verify_batch import graph_rows

            rows = graph_rows(cfg.max_num_seqs, cfg.spec_num_tokens(), token_budget)
        self.runner.capture_decode_graphs(backend, self._max_model_len, rows, cfg.enforce_eager)
        # a prefix hit's suffix, a short prompt: the decode graphs as decode rows (worker/decode_rows.py)
        self.runner.short_extends.max_tokens = short_extend_tokens(
            backend.caps, self.runner.graph_runner is not None, kv.uses_state)
        self.scheduler = Scheduler(kv, cfg.max_num_seqs, token_budget, cfg.enable_chunked_prefill)
        self.output_processor = OutputProcessor(tokenizer, eos_ids, self._max_model_len)
        self.async_scheduling = use_async_scheduling(cfg, backend, kv) and not cfg.spec_method()
        self._pipeline = StepPipeline(self.scheduler, self.runner, self.output_processor, self.async_scheduling)
        self._spec = None  # speculative decoding's pipeline (spec/pipeline.py), when it is on
        if cfg.spec_method():
            from deepinfer.spec.setup import build_spec_pipeline

            self._spec = self._pipeline = build_spec_pipeline(cfg, model, backend, self.scheduler, self.runner,
                                                              self.output_processor, layouts, self._max_model_len)

        self._job = job  # this rank's place in a parallel engine (deepinfer/parallel/), None in one process
        self._leader = None  # rank 0's LeaderDriver (deepinfer/parallel/driver.py)
        self._requests: dict[str, Request] = {}
        self._counter = 0
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._finished = 0
        groups = ", ".join(f"{g}: {n} blocks" for g, n in plan.num_blocks.items())
        quant = getattr(model, "quantization", None)
        logger.info(
            "DeepInfer: %s (%s%s) on backend %s in %s; KV cache %.1f MiB (%s, block size %d) holds %d tokens; "
            "max_model_len %d, max_num_seqs %d, token budget %d, async scheduling %s",
            cfg.model_name_or_path, getattr(model, "model_type", "?"), f", {quant}" if quant else "", backend.name,
            dtype_name(model.dtype), plan.bytes_total / 2**20, groups, block_size, plan.capacity_tokens,
            self._max_model_len, cfg.max_num_seqs, token_budget, "on" if self.async_scheduling else "off",
        )
        freeze_startup_objects()

    # ------------------------------------------------------------ properties

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def model_name(self) -> str:
        """The model path, or the embedded model's name when it runs."""
        from deepinfer.data import EMBEDDED_MODEL_NAME, embedded_model_path

        path = self.config.model_name_or_path
        return EMBEDDED_MODEL_NAME if os.path.abspath(path) == embedded_model_path() else path

    @property
    def structured_output_backend(self) -> str:
        """The grammar engine of structured output ("llguidance" or "xgrammar"): it decides the grammar syntax."""
        return self.config.structured_output_backend

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def dtype(self):
        """The compute dtype the model runs in (what dtype="auto" resolved to)."""
        return self.model.dtype

    # ------------------------------------------------------------ streaming API

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; an output for every request that got a token (cumulative).

        A request whose own work raised in the step (its sampling row, its detokenizer or stop
        checker) is finished with finish_reason "error" and RequestOutput.error set; the others
        go on (sched/step_pipeline.py). An exception that is not one request's (the model
        forward, the scheduler, a device fault) raises out of step(): then every request in
        flight should be considered failed (the HTTP server fails them all).
        """
        return self._step(all_outputs=True)

    def _step(self, all_outputs: bool) -> list[RequestOutput]:
        if self._leader is not None:  # every rank steps with the leader (deepinfer/parallel/driver.py)
            return self._leader.step(all_outputs)
        return self._local_step(all_outputs)

    def _local_step(self, all_outputs: bool) -> list[RequestOutput]:
        """One batch. all_outputs=False builds outputs only for requests that finished (generate()
        reads nothing else), so a long offline run does not copy every sequence's tokens each step.
        With async scheduling the outputs are those of the step launched by the previous call
        (sched/step_pipeline.py)."""
        seqs = self._pipeline.step()
        if self._spec is not None:
            self._gen_tokens += self._spec.take_extra_tokens()  # several tokens per sequence per step
        if not seqs:
            return []
        now = time.monotonic()
        progressed: dict[str, Request] = {}
        for seq in seqs:
            req = seq.request
            progressed[req.request_id] = req
            if seq.finish_reason == "error":  # failed in this call (sched/step_pipeline.py): maybe no token
                continue
            if req.first_token_time is None:
                req.first_token_time = now
                self._prompt_tokens += len(req.prompt_token_ids)
            self._gen_tokens += 1
        outputs = []
        make_output = self.output_processor.make_output
        for rid, req in progressed.items():
            finished = req.finished
            if finished:
                req.finished_time = now
                del self._requests[rid]
                self._finished += 1
            if finished or all_outputs:
                outputs.append(make_output(req))
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks now; unknown or finished ids are ignored.

        Returns the request's last state with finish_reason "abort" (None for unknown ids).
        """
        if self._leader is not None:
            remote, state = self._leader.abort(request_id)  # queued for every rank's next step
            if remote:  # it lived on another replica: its last reported state, ended by "abort"
                return state
        return self._local_abort(request_id)

    def _local_abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            self.output_processor.abort(seq)
            self.scheduler.remove(seq)
        if self._spec is not None:
            self._spec.flush_if_idle()  # (the last request gone: its metrics complete, on every rank)
        return self.output_processor.make_output(req)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a step is still in flight (async scheduling:
        the next step() resolves it)."""
        if self._leader is not None:
            return self._leader.has_unfinished()
        return self._local_has_unfinished()

    def _local_has_unfinished(self) -> bool:
        return bool(self._requests) or self._pipeline.has_pending()

    # ------------------------------------------------------------ many devices

    def shutdown(self) -> None:
        """Stop the other ranks of a parallel engine and leave its process group (also at interpreter exit);
        a no-op in one process."""
        if self._leader is not None:
            self._leader.shutdown()

    def _eplb_due(self, step: int) -> bool:
        return self._balancer is not None and step % self.config.eplb_step_interval == 0

    def _rebalance_experts(self) -> None:
        self.experts_moved += self._balancer.rebalance()  # experts that changed rank (EPLB)

    def stats(self) -> EngineStats:
        """This engine's load; on a parallel engine's leader, summed over the data-parallel replicas (as of
        their last step: engine/stats.py merge_replica_stats)."""
        local = self._local_stats()
        if self._leader is None or not self._leader.replica_stats:
            return local
        return merge_replica_stats([local, *self._leader.replica_stats.values()])

    def _local_stats(self) -> EngineStats:
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting}
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            kv_blocks_used=self.kv.num_blocks_used,
            kv_blocks_total=self.kv.num_blocks_total,
            kv_usage=self.kv.usage(),
            kv_capacity_tokens=self.kv_plan.capacity_tokens,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._gen_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_finished=self._finished,
            num_state_slots_used=self.kv.slots.num_used,
            num_sync_fallbacks=self._pipeline.num_sync_fallbacks,
            kv_blocks_by_group=self.kv.usage_by_group(),
            prefix_cache_queried_tokens=self.kv.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv.prefix_hit_tokens,
            prefix_cache_blocks=self.kv.num_cached_blocks,
            **(self._spec.stats_fields() if self._spec is not None else {}),
        )

    # ------------------------------------------------------------ offline API

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        **sampling_kwargs: Any,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        prompts = prompt_list(prompts)
        unfinished = len(self._requests) + (len(self._leader.remote) if self._leader is not None else 0)
        if unfinished:
            raise DeepInferError(
                f"generate() cannot run while {unfinished} requests from add_request are unfinished: "
                "their outputs come from step(); finish or abort them first"
            )
        all_params = params_list(sampling_params, sampling_kwargs, len(prompts))
        prepared = [self._prompt_ids(p) for p in prompts]  # validate all before queuing any
        ids = []
        try:
            for (text, tok), params in zip(prepared, all_params):
                rid = f"gen-{self._counter + 1}"
                while rid in self._requests or (self._leader is not None and rid in self._leader.remote):
                    self._counter += 1
                    rid = f"gen-{self._counter + 1}"
                add = self._prepare_request(rid, tok, params)
                add.prompt_text = text
                self._submit(add)
                ids.append(rid)
            return self._run_to_completion(ids, use_tqdm)
        finally:
            for rid in ids:
                self.abort_request(rid)  # no-op for finished ones; cleans up after an exception

    def _run_to_completion(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while pending:
                for out in self._step(all_outputs=False):
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
                if pending and not self.has_unfinished_requests():
                    raise DeepInferError(f"requests {sorted(pending)} vanished without finishing")
        if not self._requests and self._leader is None:  # a leader never drains alone: its ranks step together
            self._pipeline.drain()  # a step launched for sequences that finished meanwhile: nothing to output
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        **sampling_kwargs: Any,
    ) -> list[RequestOutput]:
        """Render conversations with the tokenizer's chat template, then generate."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self._tokenizer.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, **sampling_kwargs)


LLM = DeepInferenceEngine
