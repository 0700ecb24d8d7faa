"""Tokenizer: a Hugging Face `tokenizer.json` run by the `tokenizers` library, plus the chat template.

Why not transformers' AutoTokenizer: transformers is a test-only dependency here. The parts of
tokenizer_config.json the engine needs (bos / eos, add_bos_token, chat_template) are read directly
and the template is rendered with a sandboxed jinja2 environment configured as transformers does.
"""

from __future__ import annotations

import json
import os
import re
from functools import cached_property
from typing import Any

from deepinfer.errors import InvalidRequestError, ModelLoadError

# Texts longer than this are encoded with the `tokenizers` batch call, which releases the GIL
# (Tokenizer.encode holds it for the whole call: ~0.15 s for 200K characters).
_GIL_FREE_ENCODE_CHARS = 4096


def _token_str(value: Any, field: str, path: str) -> str | None:
    """bos/eos tokens appear as plain strings or as AddedToken dicts ({"content": ...})."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(f"{path}: {field} must be a string or an AddedToken dict with 'content' (got {value!r})")


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _flatten_content(content: Any, index: int) -> Any:
    """OpenAI-style content parts [{"type": "text", "text": ...}] become one string."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts are supported (got {part!r})", param="messages"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts (got {type(content).__name__})",
        param="messages",
    )


class Tokenizer:
    """Encode / decode / chat-template for one model directory."""

    def __init__(self, tokenizer, config: dict, chat_template: str | None, path: str = ""):
        self._tok = tokenizer  # tokenizers.Tokenizer
        self.path = path
        cfg_path = os.path.join(path, "tokenizer_config.json")
        self.bos_token = _token_str(config.get("bos_token"), "bos_token", cfg_path)
        self.eos_token = _token_str(config.get("eos_token"), "eos_token", cfg_path)
        self.bos_token_id = self._special_id(self.bos_token, "bos_token", cfg_path)
        self.eos_token_id = self._special_id(self.eos_token, "eos_token", cfg_path)
        if "add_bos_token" in config:
            self.add_bos_token = bool(config["add_bos_token"])
        else:  # no explicit flag: follow what tokenizer.json's post-processor does
            self.add_bos_token = self.bos_token_id is not None and self.bos_token_id in tokenizer.encode("").ids
        self.chat_template = chat_template
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}

    def _special_id(self, token: str | None, field: str, cfg_path: str) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ModelLoadError(f"{cfg_path}: {field} {token!r} is not in tokenizer.json's vocabulary")
        return tid

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        if not os.path.isdir(path):
            raise ModelLoadError(f"tokenizer directory {path!r} does not exist")
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise ModelLoadError(f"{tok_path} is missing (DeepInfer needs a Hugging Face tokenizer.json)")
        try:
            tok = HFTokenizer.from_file(tok_path)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ModelLoadError(f"{tok_path} cannot be parsed: {e}") from e
        cfg_path = os.path.join(path, "tokenizer_config.json")
        config: dict = {}
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from e
            if not isinstance(config, dict):
                raise ModelLoadError(f"{cfg_path} must hold a JSON object")
        return cls(tok, config, cls._read_chat_template(path, config, cfg_path), path)

    @staticmethod
    def _read_chat_template(path: str, config: dict, cfg_path: str) -> str | None:
        jinja_path = os.path.join(path, "chat_template.jinja")  # newer transformers save it apart
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        tpl = config.get("chat_template")
        if tpl is None or isinstance(tpl, str):
            return tpl
        if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            if isinstance(named.get("default"), str):
                return named["default"]
        raise ModelLoadError(f"{cfg_path}: chat_template must be a string or a list with a 'default' entry")

    # ---------------------------------------------------------------- encode / decode
    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included (len(tokenizer) in transformers)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS is prepended once.

        A chat-rendered prompt already starts with BOS (the template writes it), so BOS is not
        doubled: transformers would double it here, vLLM avoids it by encoding chat prompts
        without special tokens; both give the model a single BOS, and so does this.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string (got {type(text).__name__})", param="prompt")
        if len(text) <= _GIL_FREE_ENCODE_CHARS:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        else:
            # The batch call releases the GIL while it encodes (`Tokenizer.encode` holds it), so a long
            # prompt tokenized on a server worker thread does not pause the event loop; same ids.
            encode_batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
            ids = encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included (what logprobs report); memoized, since
        the same candidates recur every step and a decode call costs far more than a dict lookup."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level BPE piece may hold part of a UTF-8 character,
        whose decoded text is then U+FFFD): what the chat API's logprobs `bytes` report; memoized."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = raw_token_bytes(self, token_id, self.token_text(token_id))
        return raw

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special)

    # ---------------------------------------------------------------- chat
    @cached_property
    def _compiled_template(self):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        try:
            return env.from_string(self.chat_template)
        except TemplateError as e:
            raise ModelLoadError(f"chat_template of {self.path or 'the tokenizer'} does not compile: {e}") from e

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages with the model's template (bos_token / eos_token / raise_exception given)."""
        from jinja2.exceptions import TemplateError

        if self.chat_template is None:
            raise InvalidRequestError(
                f"the tokenizer in {self.path or '(memory)'} has no chat_template; send a plain prompt instead",
                param="messages",
            )
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {role, content} dicts", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"messages[{i}] must be a dict with a string 'role'", param="messages")
            clean.append({**m, "content": _flatten_content(m.get("content"), i)})
        try:
            return self._compiled_template.render(
                messages=clean,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}", param="messages") from e
        except TypeError as e:  # e.g. None content concatenated to a string inside the template
            raise InvalidRequestError(f"chat template cannot render these messages: {e}", param="messages") from e


def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode, used by the `tokenizers` ByteLevel
    pre-tokenizer and decoder): printable bytes stand for themselves, the others for chr(256 + i)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")  # SentencePiece byte-fallback pieces


def raw_token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """The bytes one token stands for. A byte-level BPE piece (every character in the GPT-2 byte
    alphabet) maps back to its bytes, checked against the token's decoded `text` (the decoder's lossy
    UTF-8 of those bytes), so a tokenizer of another kind never takes this path by accident; a
    `<0xNN>` byte-fallback piece is that byte; anything else (added / special tokens, other
    tokenizers) is the UTF-8 of its text."""
    pieces = tokenizer.convert_ids_to_tokens([token_id]) if hasattr(tokenizer, "convert_ids_to_tokens") else [None]
    piece = pieces[0] if pieces else None
    if piece:
        if all(c in _BYTE_DECODER for c in piece):
            raw = bytes(_BYTE_DECODER[c] for c in piece)
            if raw.decode("utf-8", "replace") == text:
                return raw
        m = _BYTE_FALLBACK.match(piece)
        if m and "\ufffd" in text:
            return bytes([int(m.group(1), 16)])
    return text.encode("utf-8", "surrogatepass")
