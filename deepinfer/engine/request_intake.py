"""Taking a request in: every check before anything is queued, the prompt's ids, the seed, the grammar, and
queuing it (DeepInferenceEngine's add_request and what a parallel engine's ranks call to enqueue what the
leader prepared: deepinfer/parallel/driver.py)."""

from __future__ import annotations

from deepinfer.errors import ConfigError, InvalidRequestError
from deepinfer.sample.penalties import params_need_penalties
from deepinfer.sampling_params import SamplingParams
from deepinfer.sched.request import Request, Sequence
from deepinfer.text.inputs import prompt_token_ids


class RequestIntake:
    """The request-intake half of DeepInferenceEngine (a mixin: it reads the engine's runtime objects)."""

    def grammar_compiler(self):
        """The structured-output compiler (engine + cache), built on first use."""
        if self._grammar_compiler is None:
            from deepinfer.sample.grammar.backend import TokenizerFacts
            from deepinfer.sample.grammar.compiler import GrammarCompiler

            cfg = self.config
            facts = TokenizerFacts.from_tokenizer(self._tokenizer, self.vocab_size, self._eos_ids)
            # a follower rank compiles what the leader already compiled within the timeout: it must not time out
            # on its own (a slower rank would fail a request the leader accepted, and stop the whole job)
            follower = self._job is not None and not self._job.is_leader
            self._grammar_compiler = GrammarCompiler(cfg.structured_output_backend, facts,
                                                     None if follower else cfg.structured_output_compile_timeout_s,
                                                     cfg.structured_output_max_bytes)
            self.runner.grammar_facts = facts
            self.runner.grammar_forbidden = facts.forbidden_mask()
        return self._grammar_compiler

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return prompt_token_ids(prompt, self._tokenizer, self.vocab_size, self._max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; raises InvalidRequestError / PromptTooLongError before anything is queued.

        Every value is checked here, so nothing reaches a step that the sampler cannot take:
        SamplingParams.validate() (the ranges in its docstring) and what needs the model:
        stop_token_ids inside the vocabulary, and a min_tokens ban (EOS + stop_token_ids) that
        leaves at least one token drawable.
        """
        self._submit(self._prepare_request(request_id, prompt, params))

    def _submit(self, add) -> None:
        if self._leader is not None:
            self._leader.add(add)  # routed to a replica; every rank of it enqueues it at the next step
        else:
            self._enqueue_prepared(add)

    def _prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None):
        """Every check of add_request, the prompt's ids and the request's base seed; nothing queued yet."""
        from deepinfer.parallel.commands import AddCommand
        from deepinfer.sample.rng import derive_seed

        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}", param="request_id")
        if request_id in self._requests or (self._leader is not None and request_id in self._leader.remote):
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}", param="params")
        params.validate()
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported yet: leave it unset", param="prompt_logprobs")
        self._check_against_model(params)
        text, ids = self._prompt_ids(prompt)
        if params.structured_outputs is not None:
            self._compile(params)  # StructuredOutputError before anything is queued (then cached)
        self._counter += 1
        base = params.seed if params.seed is not None else derive_seed(self.config.seed, self._counter)
        return AddCommand(request_id, text, ids, params, base, 0)

    def _compile(self, params: SamplingParams):
        from deepinfer.errors import StructuredOutputError

        try:
            compiler = self.grammar_compiler()
        except ConfigError as exc:  # the default engine's package missing (a deployment without llguidance)
            raise StructuredOutputError(params.structured_outputs.kind, f"structured output is unavailable: {exc}"
                                        ) from None
        return compiler, compiler.compile(params.structured_outputs)

    def _enqueue_prepared(self, add) -> None:
        """Queue a prepared request (on a parallel engine: on every rank of its replica, in the leader's order)."""
        from deepinfer.sample.rng import derive_seed

        params, compiled = add.params, None
        if params.structured_outputs is not None:
            compiler, compiled = self._compile(params)
        req = Request(request_id=add.request_id, prompt=add.prompt_text, prompt_token_ids=add.prompt_token_ids,
                      params=params, needs_host_tokens=params_need_penalties(params))
        for i in range(params.n):
            seq = Sequence(seq_id=f"{add.request_id}#{i}", request=req, index=i, seed=derive_seed(add.base_seed, i))
            if compiled is not None:
                from deepinfer.sample.grammar.matcher_state import SeqGrammar

                seq.grammar = SeqGrammar(compiler.matcher(compiled))
            self.output_processor.init_seq(seq)
            req.seqs.append(seq)
        self._requests[add.request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def _check_against_model(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise InvalidRequestError(
                f"stop_token_ids holds ids outside the vocabulary [0, {vocab}): {outside[:8]}"
                f"{' ...' if len(outside) > 8 else ''} (such a token can never be drawn)",
                param="stop_token_ids",
            )
        if params.min_tokens > 0 and len(params.stop_token_ids) + len(self.runner.sampler.eos_token_ids) >= vocab:
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned |= {t for t in self.runner.sampler.eos_token_ids if 0 <= t < vocab}
            if len(banned) >= vocab:
                raise InvalidRequestError(
                    "stop_token_ids (with EOS) cover the whole vocabulary, so no token could be drawn "
                    f"before min_tokens={params.min_tokens}", param="stop_token_ids",
                )
