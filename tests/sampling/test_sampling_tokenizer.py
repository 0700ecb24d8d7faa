"""Tokenizer factory + Tokenizer: ids, determinism, round trips, chat template (vs transformers), errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from deepinfer.checkpoints.tokenizer_factory import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    write_tokenizer,
)
from deepinfer.errors import ConfigError, InvalidRequestError, ModelLoadError
from deepinfer.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world! The quick brown fox.",
    "你好，世界！今天天气很好。",
    "龘靐齉 罕见汉字 and 𠜎𠜱 (4-byte CJK)",
    "Emoji: 🦄🧬🫠 👩🏽‍🚀 ❤️‍🔥 🇯🇵",
    "Mixed: naïve café, Привет, مرحبا, नमस्ते — ∑∞ ≠ 0",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(d, 1024)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_pretrained(tok_dir)


@pytest.mark.parametrize("vocab_size", [261, 512, 4096, 102400])
def test_factory_sizes_ids(tmp_path, vocab_size):
    # (no wall-clock assert: timings belong in benchmarks, and this one flaked on a busy CI machine)
    write_tokenizer(str(tmp_path), vocab_size)
    t = Tokenizer.from_pretrained(str(tmp_path))
    assert t.vocab_size <= vocab_size
    assert t.bos_token_id == 0 and t.eos_token_id == 1
    assert t.bos_token == BOS_TOKEN and t.eos_token == EOS_TOKEN
    assert t.token_to_id(USER_TOKEN) is not None and t.token_to_id(ASSISTANT_TOKEN) is not None
    # every id decodes (filler tokens included), and text still round-trips
    assert t.decode([vocab_size - 1]) != "" or vocab_size == 261
    for s in TEXTS:
        assert t.decode(t.encode(s)) == s


def test_factory_deterministic_and_rejects_tiny_vocab(tmp_path):
    digests = []
    for sub in ("a", "b"):
        write_tokenizer(str(tmp_path / sub), 3000)
        with open(tmp_path / sub / "tokenizer.json", "rb") as f:
            digests.append(hashlib.sha256(f.read()).hexdigest())
    assert digests[0] == digests[1]
    with pytest.raises(ConfigError, match="vocab_size"):
        write_tokenizer(str(tmp_path / "c"), 100)


def test_round_trip_and_bos(tok):
    for s in TEXTS:
        ids = tok.encode(s)
        assert ids[0] == tok.bos_token_id
        assert tok.encode(s, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == s
        assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + s
    # rare characters are split into byte tokens: the multi-byte paths are exercised
    ids = tok.encode("龘", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])
    assert tok.convert_ids_to_tokens([0, 1]) == [BOS_TOKEN, EOS_TOKEN]


def test_matches_transformers(tok, tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    for s in TEXTS:
        assert tok.encode(s) == hf.encode(s)
        assert tok.encode(s, add_special_tokens=False) == hf.encode(s, add_special_tokens=False)
        ids = hf.encode(s)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    conversations = [
        [{"role": "user", "content": "Hi 你好 🦄"}],
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "2+2?"}],
        [
            {"role": "system", "content": "A"},
            {"role": "system", "content": "B"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ],
    ]
    for msgs in conversations:
        for agp in (True, False):
            ours = tok.apply_chat_template(msgs, add_generation_prompt=agp)
            assert ours == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
            ref_ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp)
            ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
            assert tok.encode(ours) == list(ref_ids)  # one BOS, not two


def test_chat_template_output(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]},
    ]
    assert tok.apply_chat_template(msgs) == (
        f"{BOS_TOKEN}Be brief.{USER_TOKEN}Hello{ASSISTANT_TOKEN}Hi!{EOS_TOKEN}{USER_TOKEN}How are you?{ASSISTANT_TOKEN}"
    )
    assert tok.apply_chat_template(msgs[:2], add_generation_prompt=False) == f"{BOS_TOKEN}Be brief.{USER_TOKEN}Hello"
    ids = tok.encode(tok.apply_chat_template(msgs))
    assert ids.count(tok.bos_token_id) == 1 and ids.count(tok.eos_token_id) == 1


def test_chat_template_errors(tok):
    with pytest.raises(InvalidRequestError, match="Unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(InvalidRequestError, match="role"):
        tok.apply_chat_template([{"content": "x"}])
    with pytest.raises(InvalidRequestError, match="text parts"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    with pytest.raises(InvalidRequestError, match="prompt must be a string"):
        tok.encode(123)


def test_load_errors(tmp_path, tok_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_pretrained(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="tokenizer.json is missing"):
        Tokenizer.from_pretrained(str(empty))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot be parsed"):
        Tokenizer.from_pretrained(str(bad))
    badcfg = tmp_path / "badcfg"
    shutil.copytree(tok_dir, badcfg)
    (badcfg / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_pretrained(str(badcfg))
    (badcfg / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
    with pytest.raises(ModelLoadError, match="bos_token '<nope>' is not in"):
        Tokenizer.from_pretrained(str(badcfg))
    (badcfg / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(ModelLoadError, match="eos_token must be a string"):
        Tokenizer.from_pretrained(str(badcfg))


def test_plain_string_tokens_and_missing_template(tmp_path, tok_dir):
    d = tmp_path / "plain"
    shutil.copytree(tok_dir, d)
    # string bos/eos, no add_bos_token (taken from the post-processor), no chat_template
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}))
    t = Tokenizer.from_pretrained(str(d))
    assert (t.bos_token_id, t.eos_token_id, t.add_bos_token) == (0, 1, True)
    assert t.encode("hi")[0] == 0
    with pytest.raises(InvalidRequestError, match="no chat_template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS_TOKEN, "add_bos_token": False}))
    assert Tokenizer.from_pretrained(str(d)).encode("hi")[0] != 0
    # a separate chat_template.jinja (newer transformers) takes precedence
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_pretrained(str(d)).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    os.remove(d / "chat_template.jinja")
