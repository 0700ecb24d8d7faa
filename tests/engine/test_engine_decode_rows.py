"""Short extends as decode rows (worker/decode_rows.py) on the cpu backend, fp32, tiny-v3: a prefix hit's suffix
(and a short fresh prompt in the same step) run as one decode row per token through a graph runner give the
tokens of the eager extend and its logprobs within fp32 rounding; bitwise under batch invariance; the knob's bad
values are named errors.

The cpu backend captures no graphs, so `RowReplayRunner` stands in for one: it takes decode-only batches of at
most `max_rows` rows and runs the model on them, which is what a captured decode graph computes once the batch
sits in its static inputs (the padding and static buffers of the contract's runner are tested in
tests/engine/test_engine_seams.py; the nvidia backend's decode rows under its real kernels, with that runner, in
tests/nvidia/test_nvidia_decode_rows.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from deepinfer import EngineConfig, SamplingParams
from deepinfer.backend import BackendCaps, ForwardBatch, GraphRunner
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.engine import DeepInferenceEngine
from deepinfer.errors import ConfigError
from deepinfer.models.registry import load_model
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.worker.decode_rows import ShortExtends, decode_shaped, short_extend_tokens

VAR = "DEEPINFER_DECODE_ROWS_MAX_TOKENS"
PREFIX = [0] + [(13 * i + 7) % 900 + 2 for i in range(36)]  # 37 tokens: two full 16-token blocks cached
HIT = PREFIX + [(31 * i + 5) % 900 + 2 for i in range(6)]  # 43 tokens: 32 from the cache, an 11-token suffix
FRESH = [0, 44, 91, 17, 250]  # a short new prompt in the hit's step
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)


class RowReplayRunner(GraphRunner):
    """Replays decode-only batches of at most max_rows rows by running the model on them (see the module docstring);
    records the row count of every batch it ran."""

    def __init__(self, model, caches, max_rows: int):
        self.model, self.caches, self.max_rows = model, caches, max_rows
        self.rows: list[int] = []

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode_only and batch.num_seqs <= self.max_rows

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.rows.append(batch.num_seqs)
        return self.model.forward(batch, self.caches)


class RowsCPU(CPUBackend):
    """The cpu backend declaring decode graphs whose decode path takes several rows of one sequence (its MLA op
    writes every row's KV before attending, as spec's eager decode rows rely on)."""

    decode_rows = True

    @property
    def caps(self) -> BackendCaps:
        return replace(super().caps, graph_capture=True, graph_decode_rows=self.decode_rows)

    def make_graph_runner(self, model, caches, block_size, max_model_len, max_num_seqs):
        return RowReplayRunner(model, caches, max_num_seqs)


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny-v3")


def _engine(path: str, invariant: bool = False, caching: bool = True, backend_cls=RowsCPU) -> DeepInferenceEngine:
    backend = backend_cls()
    if invariant:
        backend.enable_batch_invariance()
    model = load_model(path, backend, torch.float32, progress=False)
    cfg = EngineConfig(path, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32, max_num_seqs=16,
                       enable_prefix_caching=caching, batch_invariant=invariant, load_progress=False)
    return DeepInferenceEngine.from_components(cfg, model, Tokenizer.from_pretrained(path), backend)


def _traces(engine, prompts):
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs] for o in outs],
            [o.num_cached_tokens for o in outs])


def _run(path, monkeypatch, max_tokens: int, **kw):
    """(engine, traces of [FRESH, HIT] after PREFIX ran alone) with the knob at max_tokens."""
    monkeypatch.setenv(VAR, str(max_tokens))
    engine = _engine(path, **kw)
    monkeypatch.delenv(VAR)
    engine.generate([PREFIX], GREEDY, use_tqdm=False)  # cached: the next run of HIT hits 32 tokens
    return engine, _traces(engine, [FRESH, HIT])


def test_a_prefix_hit_through_decode_rows_equals_the_eager_extend(path, monkeypatch):
    rows, (r_tok, r_lp, r_cached) = _run(path, monkeypatch, 64)
    eager, (e_tok, e_lp, e_cached) = _run(path, monkeypatch, 0)
    assert r_cached == e_cached == [0, 32]
    ext = rows.runner.short_extends
    # PREFIX alone (37 rows, beyond the largest bucket: eager), then FRESH + HIT's suffix (5 + 11 tokens)
    assert ext.max_tokens == 64 and ext.num_steps == 1, ext
    assert 16 in rows.runner.graph_runner.rows  # that step's 16 tokens as 16 decode rows
    assert eager.runner.short_extends.num_steps == 0 and 16 not in eager.runner.graph_runner.rows
    assert r_tok == e_tok
    for a, b in zip(r_lp, e_lp):  # the same attention in another fp32 summation order (decode vs prefill path)
        for sa, sb in zip(a, b):
            assert sa.keys() == sb.keys() and all(math.isclose(sa[t], sb[t], rel_tol=4e-6, abs_tol=4e-6) for t in sa)


def test_decode_rows_are_bitwise_under_batch_invariance(path, monkeypatch):
    """The hit's suffix as decode rows equals a miss whose prompts are prefilled eagerly, bit for bit."""
    rows, (r_tok, r_lp, r_cached) = _run(path, monkeypatch, 64, invariant=True)
    miss, (m_tok, m_lp, m_cached) = _run(path, monkeypatch, 0, invariant=True, caching=False)
    assert r_cached == [0, 32] and m_cached == [0, 0]
    assert rows.runner.short_extends.num_steps == 1 and miss.runner.short_extends.num_steps == 0
    assert (r_tok, r_lp) == (m_tok, m_lp)


def test_only_short_steps_that_a_bucket_covers_are_flattened():
    def batch(qlens, ctx):
        t = sum(qlens)
        pos = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctx)])
        return ForwardBatch(
            input_ids=torch.arange(t), positions=pos,
            query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor([q + c for q, c in zip(qlens, ctx)], dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            block_tables={"mla": torch.zeros(len(qlens), 4, dtype=torch.int32)},
            slot_mapping={"mla": torch.arange(t)}, logits_indices=torch.tensor([t - 1]),
            query_lens_cpu=list(qlens), seq_lens_cpu=[q + c for q, c in zip(qlens, ctx)], context_lens_cpu=list(ctx),
            block_size=16)

    runner = RowReplayRunner(None, None, max_rows=8)
    rule = ShortExtends(max_tokens=6)
    flat = rule.flatten(batch([5, 1], [32, 9]), runner)  # a suffix of 5 and a decode: 6 rows
    assert flat is not None and flat.is_decode_only and flat.num_seqs == 6 and rule.num_steps == 1
    assert flat.seq_lens.tolist() == [33, 34, 35, 36, 37, 10]
    assert rule.flatten(batch([7], [0]), runner) is None  # more tokens than max_tokens
    assert rule.flatten(batch([1, 1], [3, 4]), runner) is None  # decode-only: the graph runs it as it is
    assert ShortExtends(max_tokens=16).flatten(batch([9], [0]), runner) is None  # 9 rows: no bucket covers them
    assert rule.flatten(batch([5], [0]), None) is None  # no graphs
    b = batch([3], [0])
    b.state_slots, b.state_slots_cpu = torch.tensor([0], dtype=torch.int32), [0]
    assert rule.flatten(b, runner) is None  # per-sequence state (V4): never
    assert ShortExtends().flatten(batch([2], [0]), runner) is None and rule.num_steps == 1  # 0: off
    with pytest.raises(ValueError, match="per-sequence state"):
        decode_shaped(b)


@pytest.mark.parametrize("value,message", [("-1", "must be an integer in \\[0, 1024\\]"),
                                           ("2048", "must be an integer in \\[0, 1024\\]"),
                                           ("many", "is not an integer")])
def test_bad_knob_values_are_named(monkeypatch, value, message):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(ConfigError, match=f"{VAR}={value!r} {message}"):
        short_extend_tokens(RowsCPU().caps, True, False)


def test_the_knob_on_graphs_not_declared_exact_for_decode_rows_is_an_error(path, monkeypatch):
    class Undeclared(RowsCPU):
        decode_rows = False

    caps = Undeclared().caps
    assert short_extend_tokens(caps, True, False) == 0  # unset: off there, quietly (the default)
    monkeypatch.setenv(VAR, "32")
    with pytest.raises(ConfigError, match=f"{VAR}=32: .*graph_decode_rows"):
        _engine(path, backend_cls=Undeclared)
    # nothing to replay: no graphs, V4's state -> 0 (logged), not an error; speculation applies it to its own steps
    assert short_extend_tokens(caps, False, False) == 0
    assert short_extend_tokens(RowsCPU().caps, True, True) == 0
    assert short_extend_tokens(RowsCPU().caps, True, False) == 32


def test_speculative_steps_with_short_prompts_run_as_decode_rows(path, monkeypatch):
    """spec/pipeline.py applies the same rule to its steps with prompt chunks: [FRESH, HIT]'s first step (16 + 43
    rows, no cache) replays as decode rows with the knob at 64, and the outputs equal the knob at 0 (eager)."""
    got = {}
    for knob in (0, 64):
        monkeypatch.setenv(VAR, str(knob))
        backend = RowsCPU()
        model = load_model(path, backend, torch.float32, progress=False)
        cfg = EngineConfig(path, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=16,
                           enable_prefix_caching=False, speculative_method="ngram", num_speculative_tokens=2,
                           load_progress=False)
        engine = DeepInferenceEngine.from_components(cfg, model, Tokenizer.from_pretrained(path), backend)
        monkeypatch.delenv(VAR)
        got[knob] = (_traces(engine, [FRESH, HIT]), engine.runner.short_extends.num_steps,
                     list(engine.runner.graph_runner.rows))
    (tok0, lp0, _), steps0, rows0 = got[0]
    (tok1, lp1, _), steps1, rows1 = got[64]
    assert steps0 == 0 and len(FRESH) + len(HIT) not in rows0
    assert steps1 >= 1 and len(FRESH) + len(HIT) in rows1  # the prompts' step, as one decode row per token
    assert tok1 == tok0
    for a, b in zip(lp0, lp1):
        for sa, sb in zip(a, b):
            assert sa.keys() == sb.keys()
            assert all(math.isclose(sa[t], sb[t], rel_tol=4e-6, abs_tol=4e-6) for t in sa)
