"""POST /v1/chat/completions: messages -> chat template -> one engine request with n sequences."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.entrypoints.openai.async_engine import EngineStepError, RequestFailedError
from deepinfer.entrypoints.openai.chat_output import ChoiceParser, delta_message, whole_message
from deepinfer.entrypoints.openai.errors import bad_request
from deepinfer.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from deepinfer.entrypoints.openai.reasoning_parser import REASONING_PREFIX, THINK_TOKENS
from deepinfer.entrypoints.openai.request_checks import check_caps, check_unicode, check_unsupported
from deepinfer.entrypoints.openai.request_context import current_request
from deepinfer.entrypoints.openai.serving_common import (
    ServerState,
    build_sampling_params,
    check_prompt_ids,
    collect,
    encode_text,
    new_id,
    off_loop,
    run_until_disconnect,
    submit_all,
)
from deepinfer.entrypoints.openai.serving_output import (
    LOGPROB_FLOOR,
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
from deepinfer.entrypoints.openai.structured import StructuredRequest, after_prefix, structured_request
from deepinfer.entrypoints.openai.tool_parser import TOOL_TOKENS
from deepinfer.entrypoints.openai.tools import ToolPlan, plan_tools
from deepinfer.sampling_params import StructuredOutputsParams


def _token_logprob(state: ServerState, token_id: int, logprob: float) -> dict:
    # bytes: the token's raw bytes (not the UTF-8 of its text, which is U+FFFD for part of a
    # character), so a client can join them to rebuild multi-byte characters, as OpenAI's are
    return {"token": state.token_text(token_id), "logprob": finite_logprob(logprob),
            "bytes": list(state.token_bytes(token_id))}


def _logprobs(state: ServerState, token_ids, entries, k: int) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, entries):
        entry = entry or {}
        top = [TopLogprob(**_token_logprob(state, e.token_id, e.logprob)) for e in top_entries(entry, k)]
        chosen = chosen_logprob(entry, tid)
        chosen = chosen if chosen is not None else LOGPROB_FLOOR
        content.append(ChatTokenLogprob(**_token_logprob(state, tid, chosen), top_logprobs=top))
    return ChatLogprobs(content=content)


def _message_dict(i: int, m) -> dict:
    if m.role in ("user", "system", "developer", "tool") and m.content is None:
        raise bad_request(f"messages[{i}].content is required for role {m.role}", "messages")
    if m.tool_calls and m.role != "assistant":
        raise bad_request(f"messages[{i}].tool_calls is only allowed on assistant messages", "messages")
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.role == "assistant" and m.content is None:
        out["content"] = None
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def render_chat(state: ServerState, chat_messages, add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """The conversation rendered by the model's chat template (worker thread); 400 when it cannot be.
    `tools` (OpenAI's tool dicts) are given to the template, which describes them to the model."""
    if not chat_messages:
        raise bad_request("messages must hold at least one message", "messages")
    messages = [_message_dict(i, m) for i, m in enumerate(chat_messages)]
    extra = {"tools": tools} if tools else {}
    try:
        return state.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:  # a template that raises (jinja2 `raise_exception`) rejects the conversation
        raise bad_request(f"messages cannot be rendered by the chat template: {exc}", "messages") from None


def encode_chat(state: ServerState, chat_messages, add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> list[int]:
    """The prompt ids of a conversation, as /v1/chat/completions feeds them (BOS once, as engine.chat does)."""
    return encode_text(state, render_chat(state, chat_messages, add_generation_prompt, tools), "messages")


def plan_output(state: ServerState, req) -> tuple[ToolPlan | None, StructuredRequest | None]:
    """The request's tools and its one constraint (tool grammar, response_format, ...), with the
    reasoning section in front when the server parses reasoning; 400 for a combination it cannot honour."""
    plan = plan_tools(req, state.tokenizer, REASONING_PREFIX if state.reasoning_parser else "")
    structured = structured_request(req, state.json_whitespace)
    if plan is not None and plan.choice != "none" and structured is not None:
        raise bad_request(f"{structured.field} cannot be combined with tools (tool_choice {plan.choice!r}): the "
                          "output is either tool calls or the structured answer", structured.field,
                          "conflicting_parameters")
    tool_grammar = plan is not None and plan.grammar is not None
    if state.reasoning_parser and (structured is not None or tool_grammar):
        if any(state.tokenizer.token_to_id(t) is None for t in THINK_TOKENS):
            field = structured.field if structured is not None else "tools"
            raise bad_request(f"{field} is not supported with --reasoning-parser on this model: its tokenizer lacks "
                              "<think> / </think>, so the constraint cannot start after the reasoning", field,
                              "unsupported_parameter")
        if structured is not None:
            structured = after_prefix(structured, REASONING_PREFIX)
    if tool_grammar:
        structured = StructuredRequest("tools", StructuredOutputsParams(grammar=plan.grammar))
    server_built = tool_grammar or (state.reasoning_parser and structured)
    if server_built and state.structured_backend != "llguidance":
        field = structured.field
        raise bad_request(f"{field}: this needs a grammar the server writes in llguidance's Lark syntax, but the "
                          f"engine runs {state.structured_backend} (start it with --structured-output-backend "
                          "llguidance)", field, "unsupported_parameter")
    return plan, structured


def _keep_special(state: ServerState, plan: ToolPlan | None) -> bool | None:
    """skip_special_tokens=False when a token the parsers look for is special in this tokenizer (it
    would be dropped from the text); None: the request's own value."""
    wanted = (TOOL_TOKENS if plan is not None and plan.parse else []) + (THINK_TOKENS if state.reasoning_parser else [])
    ids = {state.tokenizer.token_to_id(t) for t in wanted} - {None}
    special = getattr(state.tokenizer, "special_token_ids", frozenset())
    return False if ids & special else None


class ChatHandler:
    def __init__(self, state: ServerState):
        self.state = state

    def _prompt_ids(self, req: ChatCompletionRequest, max_tokens: int | None, max_param: str,
                    plan: ToolPlan | None = None) -> list[int]:
        """Render the template and tokenize (worker thread); the context checks included."""
        ids = self._render_and_encode(req, plan)
        check_prompt_ids(self.state, ids, max_tokens, "messages", max_param)
        return ids

    def _render_and_encode(self, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
        return encode_chat(self.state, req.messages, tools=plan.tools if plan is not None else None)

    async def create(self, req: ChatCompletionRequest, raw: Request):
        state = self.state
        await off_loop(state, check_unicode, req)  # before anything echoes a string back
        model = state.check_model(req.model)
        check_unsupported(req, "chat")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        check_caps(
            state.limits, state.max_model_len, num_prompts=1, n=req.n, stop=req.stop, logprobs=logprobs,
            logprobs_param="top_logprobs", max_tokens=max_tokens, max_param=max_param,
        )
        rename = {"max_tokens": max_param, "logprobs": "top_logprobs"}
        effective_max = max_tokens if max_tokens is not None else state.limits.max_output_tokens
        plan, structured = plan_output(state, req)
        params = build_sampling_params(req, effective_max, logprobs, rename, structured, _keep_special(state, plan))
        prompt_ids = await off_loop(state, self._prompt_ids, req, max_tokens, max_param, plan)
        ctx = current_request()
        if ctx is not None:
            ctx.prompt_tokens = len(prompt_ids)
        request_id = new_id("chatcmpl")
        handles = await submit_all(state, request_id, [prompt_ids], params, rename,
                                   structured.field if structured else None)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        parse = (bool(state.reasoning_parser), plan is not None and plan.parse)
        if req.stream:
            body = self._stream(request_id, model, handles[0], len(prompt_ids), logprobs, include_usage, parse)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            final = await run_until_disconnect(raw, collect(handles[0]))
        except RequestFailedError as exc:
            raise request_failed(exc, request_id) from None
        except EngineStepError:
            raise step_failed(request_id) from None
        return JSONResponse(self._response(request_id, model, final, logprobs, parse).model_dump())

    def _response(self, request_id, model, out, logprobs: int | None, parse=(False, False)) -> ChatCompletionResponse:
        choices, completion_tokens = [], 0
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            lp = _logprobs(self.state, c.token_ids, c.logprobs or [], logprobs) if logprobs is not None else None
            message, finish_reason = whole_message(ChoiceParser.make(*parse), c.text, c.finish_reason)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=lp,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        usage = usage_info(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens or 0)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(self, request_id, model, handle, prompt_tokens: int, logprobs: int | None, include_usage: bool,
                      parse=(False, False)):
        created = int(time.time())
        deltas = ChoiceDeltas(logprobs is not None)
        parsers: dict[int, ChoiceParser | None] = {}

        def chunk(choices, usage=None) -> str:
            return chunk_event(
                ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage),
                include_usage,
            )

        cached = 0
        try:
            async for out in handle.outputs():
                cached = out.num_cached_tokens or 0
                choices = []
                for c in out.outputs:
                    if c.index not in deltas.trackers:  # first chunk of a choice carries the role, as OpenAI does
                        yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                        parsers[c.index] = ChoiceParser.make(*parse)
                    delta = deltas.delta(c.index, c)
                    if delta is None:
                        continue
                    text, tokens, entries = delta
                    parser = parsers[c.index]
                    message = delta_message(parser, text, c.finished)
                    if message is None and not c.finished and not (logprobs is not None and tokens):
                        continue  # held back by a parser (a marker may be starting)
                    lp = _logprobs(self.state, tokens, entries, logprobs) if logprobs is not None else None
                    reason = parser.finish_reason(c.finish_reason) if parser is not None else c.finish_reason
                    choices.append(
                        ChatChunkChoice(
                            index=c.index,
                            delta=message or DeltaMessage(),
                            logprobs=lp,
                            finish_reason=reason,
                            stop_reason=c.stop_reason,
                        )
                    )
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage_info(prompt_tokens, deltas.completion_tokens, cached))
        except Exception as exc:
            yield stream_error_event(exc, request_id)
        yield sse("[DONE]")
