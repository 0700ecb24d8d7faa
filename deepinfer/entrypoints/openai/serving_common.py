"""What the completions and chat handlers share: request -> SamplingParams,
prompt checks, submitting to the engine loop, output deltas, logprobs, SSE.

Per-request work that could take long (the Unicode walk, chat-template rendering, tokenization)
runs on a small thread pool (`off_loop`), never on the event loop; JSON bodies never hold NaN
or Infinity (a log-probability of -inf is written as LOGPROB_FLOOR, and serialization refuses
NaN, so a bug is an error, not invalid JSON).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from deepinfer.entrypoints.openai.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    QueueFullError,
    RequestHandle,
)
from deepinfer.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    from_invalid_request,
    overloaded,
)
from deepinfer.entrypoints.openai.request_checks import PromptTooLong, ServerLimits, encode_within
from deepinfer.entrypoints.openai.request_context import current_request, new_request_id
from deepinfer.entrypoints.openai.structured import StructuredRequest, rename_structured
from deepinfer.errors import InvalidRequestError
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer.server")


@dataclass
class ServerState:
    """Everything a handler needs, built once by build_app."""

    async_engine: AsyncEngine
    tokenizer: object
    served_model_names: list[str]
    max_model_len: int
    model_path: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    reasoning_parser: str | None = None  # "deepseek_r1": <think>...</think> -> reasoning_content (chat)
    structured_backend: str = "llguidance"  # the engine's grammar engine (the Lark grammars the server builds)
    json_whitespace: str = "flexible"  # JSON constraints' whitespace unless a request says (--json-whitespace)
    # tokenization, chat templates, request walks: off the event loop, bounded
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="deepinfer-prep"
        )
    )

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a name this server does not serve."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves {self.served_model_names}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return model

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)  # memoized by the tokenizer, shared with the engine

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes (chat logprobs `bytes`; text/tokenizer.py, memoized there)."""
        return self.tokenizer.token_bytes(token_id)


def new_id(prefix: str) -> str:
    """`<prefix>-<request id>`: the HTTP request's id (X-Request-Id, or one the server made)."""
    ctx = current_request()
    return f"{prefix}-{ctx.request_id if ctx is not None else new_request_id()}"


async def off_loop(state: ServerState, fn, *args):
    """fn(*args) on the server's worker threads (the request's context, so its logs carry its id)."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    return await loop.run_in_executor(state.executor, ctx.run, fn, *args)


def context_too_long(state: ServerState, prompt_param: str, num_tokens: int, at_least: bool = False) -> OpenAIError:
    limit = state.max_model_len
    has = f"at least {num_tokens}" if at_least else str(num_tokens)
    return bad_request(
        f"This model's maximum context length is {limit} tokens, but the prompt ({prompt_param}) has "
        f"{has} tokens; reduce its length",
        prompt_param,
        "context_length_exceeded",
    )


def encode_text(state: ServerState, text: str, prompt_param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt (worker thread); a text that cannot fit max_model_len is refused
    after tokenizing about max_model_len tokens of it (request_checks.encode_within)."""
    try:
        return encode_within(state.tokenizer, text, state.max_model_len, add_special_tokens)
    except PromptTooLong as exc:
        raise context_too_long(state, prompt_param, exc.at_least, at_least=True) from None


def build_sampling_params(req, max_tokens: int | None, logprobs: int | None, rename: dict[str, str],
                          structured: StructuredRequest | None = None,
                          skip_special_tokens: bool | None = None) -> SamplingParams:
    """OpenAI fields -> SamplingParams; its validation errors become 400s naming the request's field."""
    kwargs = dict(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,  # SamplingParams takes a string, a list or None
        stop_token_ids=req.stop_token_ids,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        logprobs=logprobs,
    )
    if structured is not None:
        kwargs["structured_outputs"] = structured.params
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by DeepInfer", "logit_bias", "unsupported_parameter")
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        mapped = rename_structured(exc, structured.field if structured else None)
        raise (mapped or from_invalid_request(exc, rename)) from None


def check_prompt_ids(state: ServerState, ids: list[int], max_tokens: int | None, prompt_param: str, max_param: str) -> None:
    """400 when the prompt is empty, holds unknown ids, or prompt + max_tokens exceeds the context."""
    if not ids:
        raise bad_request(f"{prompt_param} must not be empty", prompt_param)
    limit = state.max_model_len
    if len(ids) >= limit:  # before the O(len) vocabulary scan
        raise context_too_long(state, prompt_param, len(ids))
    vocab = getattr(state.tokenizer, "vocab_size", None)
    if vocab is not None and any(t < 0 or t >= vocab for t in ids):
        raise bad_request(f"{prompt_param} holds token ids outside [0, {vocab})", prompt_param)
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but {len(ids) + max_tokens} were requested "
            f"({len(ids)} in the prompt, {max_tokens} in {max_param}); reduce {max_param} or the prompt",
            max_param,
            "context_length_exceeded",
        )


async def submit(state: ServerState, request_id: str, prompt_ids: list[int], params: SamplingParams, rename,
                 structured_field: str | None = None) -> RequestHandle:
    """add_request with its failures mapped to status codes (a StructuredOutputError: a 400 naming
    `structured_field`, the request field the constraint came from, and the keyword)."""
    try:
        try:
            return await state.async_engine.add_request(request_id, prompt_ids, params)
        except InvalidRequestError as exc:
            if exc.param != "request_id":
                raise
            # A client reused an X-Request-Id still in flight: the engine needs unique ids.
            unique = f"{request_id}~{uuid.uuid4().hex[:8]}"
            logger.info("engine request id %s is in use; using %s", request_id, unique)
            return await state.async_engine.add_request(unique, prompt_ids, params)
    except InvalidRequestError as exc:
        raise (rename_structured(exc, structured_field) or from_invalid_request(exc, rename)) from None
    except QueueFullError as exc:
        raise overloaded(str(exc)) from None
    except EngineStoppedError as exc:
        raise overloaded(str(exc), retry_after_s=5) from None


async def submit_all(state: ServerState, base_id: str, prompts: list[list[int]], params, rename,
                     structured_field: str | None = None) -> list[RequestHandle]:
    """Submit every prompt; if one is refused, abort the ones already queued."""
    handles: list[RequestHandle] = []
    try:
        for i, ids in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            handles.append(await submit(state, rid, ids, params, rename, structured_field))
    except BaseException:
        for h in handles:
            h.abort()
        raise
    return handles


async def collect(handle: RequestHandle) -> RequestOutput:
    """Run one request to completion (non-streaming)."""
    last = None
    async for out in handle.outputs():
        last = out
    return last


async def run_until_disconnect(request: Request, coro):
    """Await `coro`, cancelling it (and so aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its finally blocks abort the engine requests
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise OpenAIError(499, "client disconnected", "invalid_request_error", None, "client_disconnected")
    return task.result()


async def merge(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several requests as (prompt index, output)."""
    if len(handles) == 1:
        async for out in handles[0].outputs():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle):
        try:
            async for out in h.outputs():
                await queue.put((i, out))
        except BaseException as exc:
            await queue.put((i, exc))
            raise
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            h.abort()
