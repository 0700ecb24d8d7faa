"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize takes a text `prompt` (+ `add_special_tokens`, default true) or chat `messages`
(+ `add_generation_prompt`, default true) and answers `{"count", "max_model_len", "tokens"}` (and
`token_strs` when `return_token_strs`): exactly the ids /v1/completions or /v1/chat/completions
would feed the model. /detokenize takes `tokens` and answers `{"prompt": text}` (special tokens
included, as vLLM's). Both go through the same checks as the completion endpoints: the API key,
valid Unicode everywhere, a known model, and the context / work bounds (a prompt of
`max_model_len` tokens or more, which no completion could take, is a 400, found after tokenizing
about that many tokens; at most `max_model_len` ids to detokenize, each inside the vocabulary).
The work runs off the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deepinfer.entrypoints.openai.errors import bad_request
from deepinfer.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from deepinfer.entrypoints.openai.request_checks import check_unicode, check_unsupported, over_cap
from deepinfer.entrypoints.openai.serving_chat import encode_chat
from deepinfer.entrypoints.openai.serving_common import ServerState, context_too_long, encode_text, off_loop


def _validate(model, data: Any):
    """`data` as `model`; pydantic's errors become the 400 every endpoint gives (errors.py)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
        raise RequestValidationError(errors) from None


def parse_tokenize(data: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A body with `messages` is a chat request, otherwise a text one (vLLM's union, decided by the
    field present so a bad message is reported as such); both fields at once is a 400."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", "body")
    if "messages" in data:
        if "prompt" in data:
            raise bad_request("give prompt or messages, not both", "prompt")
        return _validate(TokenizeChatRequest, data)
    return _validate(TokenizeCompletionRequest, data)


class TokenizeHandler:
    def __init__(self, state: ServerState):
        self.state = state

    async def tokenize(self, data: Any):
        state = self.state
        req = parse_tokenize(data)
        await off_loop(state, check_unicode, req)
        state.check_model(req.model)
        chat = isinstance(req, TokenizeChatRequest)
        check_unsupported(req, "tokenize_chat" if chat else "tokenize")
        if chat:
            ids = await off_loop(state, encode_chat, state, req.messages, req.add_generation_prompt)
        else:
            ids = await off_loop(state, encode_text, state, req.prompt, "prompt", req.add_special_tokens)
        if len(ids) >= state.max_model_len:  # as the completion endpoints: it could not be served
            raise context_too_long(state, "messages" if chat else "prompt", len(ids))
        body = TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)
        if req.return_token_strs:
            body.token_strs = [t if t is not None else "" for t in state.tokenizer.convert_ids_to_tokens(ids)]
        return JSONResponse(body.model_dump(exclude_none=True))

    async def detokenize(self, data: Any):
        state = self.state
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object", "body")
        req = _validate(DetokenizeRequest, data)
        await off_loop(state, check_unicode, req)
        state.check_model(req.model)
        check_unsupported(req, "detokenize")
        ids = req.tokens
        if len(ids) > state.max_model_len:
            raise over_cap(f"tokens: {len(ids)} ids; the server detokenizes at most max_model_len = "
                           f"{state.max_model_len} per request", "tokens")
        vocab = getattr(state.tokenizer, "vocab_size", None)
        if vocab is not None and any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"tokens holds token ids outside [0, {vocab})", "tokens")
        text = await off_loop(state, lambda: state.tokenizer.decode(ids, skip_special_tokens=False))
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
