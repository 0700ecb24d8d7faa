"""POST /v1/completions: prompts (text or token ids, one or many) -> completions, streamed or not."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.entrypoints.openai.async_engine import EngineStepError, RequestFailedError
from deepinfer.entrypoints.openai.contract import completion_default_max_tokens
from deepinfer.entrypoints.openai.errors import bad_request
from deepinfer.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from deepinfer.entrypoints.openai.request_checks import check_caps, check_unicode, check_unsupported
from deepinfer.entrypoints.openai.request_context import current_request
from deepinfer.entrypoints.openai.serving_common import (
    ServerState,
    build_sampling_params,
    check_prompt_ids,
    collect,
    encode_text,
    merge,
    new_id,
    off_loop,
    run_until_disconnect,
    submit_all,
)
from deepinfer.entrypoints.openai.serving_output import (
    ChoiceDeltas,
    chosen_logprob,
    chunk_event,
    finite_logprob,
    request_failed,
    sse,
    step_failed,
    stream_error_event,
    top_entries,
    usage_info,
)
from deepinfer.entrypoints.openai.structured import structured_request


def _num_prompts(prompt) -> int:
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _prompt_ids(state: ServerState, prompt) -> list[list[int]]:
    """Normalise the four prompt forms to token-id lists (tokenized as engine.generate does; a text
    that cannot fit the context is refused before it is tokenized in full). Worker thread."""
    if isinstance(prompt, str):
        return [encode_text(state, prompt, "prompt")]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return [encode_text(state, p, "prompt") for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _prepare_prompts(state: ServerState, prompt, max_tokens: int | None) -> list[list[int]]:
    prompts = _prompt_ids(state, prompt)
    for ids in prompts:
        check_prompt_ids(state, ids, max_tokens, "prompt", "max_tokens")
    return prompts


def _logprobs(state: ServerState, token_ids, entries, k: int, offset: int) -> tuple[CompletionLogprobs, int]:
    lp = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries):
        text = state.token_text(tid)
        lp.tokens.append(text)
        lp.token_logprobs.append(chosen_logprob(entry, tid) if entry else None)
        lp.top_logprobs.append(
            {state.token_text(e.token_id): finite_logprob(e.logprob) for e in top_entries(entry, k)} if entry else None
        )
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


class CompletionsHandler:
    def __init__(self, state: ServerState):
        self.state = state

    async def create(self, req: CompletionRequest, raw: Request):
        state = self.state
        await off_loop(state, check_unicode, req)  # before anything echoes a string back
        model = state.check_model(req.model)
        check_unsupported(req, "completions")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported by DeepInfer", "best_of", "unsupported_parameter")
        if "max_tokens" not in req.model_fields_set:  # OpenAI's default of 16, within --max-output-tokens
            req.max_tokens = completion_default_max_tokens(state.limits)
        check_caps(
            state.limits, state.max_model_len, num_prompts=_num_prompts(req.prompt), n=req.n, stop=req.stop,
            logprobs=req.logprobs, logprobs_param="logprobs", max_tokens=req.max_tokens, max_param="max_tokens",
        )
        max_tokens = req.max_tokens if req.max_tokens is not None else state.limits.max_output_tokens
        structured = structured_request(req, state.json_whitespace)
        params = build_sampling_params(req, max_tokens, req.logprobs, {}, structured)
        prompts = await off_loop(state, _prepare_prompts, state, req.prompt, req.max_tokens)
        ctx = current_request()
        if ctx is not None:
            ctx.prompt_tokens = sum(len(ids) for ids in prompts)
        request_id = new_id("cmpl")
        handles = await submit_all(state, request_id, prompts, params, {}, structured.field if structured else None)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            body = self._stream(request_id, model, handles, prompts, req, include_usage)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            finals = await run_until_disconnect(raw, self._collect_all(handles))
        except RequestFailedError as exc:
            raise request_failed(exc, request_id) from None
        except EngineStepError:
            raise step_failed(request_id) from None
        return JSONResponse(self._response(request_id, model, finals, req).model_dump())

    @staticmethod
    async def _collect_all(handles):
        try:
            return await asyncio.gather(*(collect(h) for h in handles))
        finally:
            for h in handles:
                h.abort()

    def _response(self, request_id, model, finals, req: CompletionRequest) -> CompletionResponse:
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for p, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens or 0
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp, _ = _logprobs(self.state, c.token_ids, c.logprobs or [], req.logprobs, 0)
                choices.append(
                    CompletionChoice(
                        index=p * req.n + c.index,
                        text=c.text,
                        logprobs=lp,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage_info(prompt_tokens, completion_tokens, cached)
        )

    async def _stream(self, request_id, model, handles, prompts, req: CompletionRequest, include_usage: bool):
        created = int(time.time())
        deltas = ChoiceDeltas(req.logprobs is not None)
        offsets: dict[int, int] = {}

        def chunk(choices, usage=None) -> str:
            return chunk_event(
                CompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage), include_usage
            )

        cached: dict[int, int] = {}  # prompt index -> its cached tokens (known once it is admitted)
        try:
            async for p, out in merge(handles):
                cached[p] = out.num_cached_tokens or 0
                choices = []
                for c in out.outputs:
                    index = p * req.n + c.index
                    delta = deltas.delta(index, c)
                    if delta is None:
                        continue
                    text, tokens, entries = delta
                    lp = None
                    if req.logprobs is not None:
                        lp, offsets[index] = _logprobs(self.state, tokens, entries, req.logprobs, offsets.get(index, 0))
                    choices.append(
                        CompletionChoice(
                            index=index, text=text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason
                        )
                    )
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage_info(sum(len(ids) for ids in prompts), deltas.completion_tokens,
                                           sum(cached.values())))
        except Exception as exc:  # after the 200 went out: report in-band, then end the stream
            yield stream_error_event(exc, request_id)
        yield sse("[DONE]")
