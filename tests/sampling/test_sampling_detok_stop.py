"""IncrementalDetokenizer (multi-byte safety, special tokens) and StopChecker (streaming hold-back)."""

from __future__ import annotations

import random

import pytest

from deepinfer.checkpoints.tokenizer_factory import EOS_TOKEN, USER_TOKEN, write_tokenizer
from deepinfer.errors import InvalidRequestError
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.stop_checker import StopChecker
from deepinfer.text.tokenizer import Tokenizer

MULTIBYTE = [
    "龘靐齉 罕见汉字 𠜎𠜱 and 你好世界",
    "🦄🧬🫠 👩🏽‍🚀 ❤️‍🔥 🇯🇵 ok",
    "naïve café — Привет мир ∑∞≠0 नमस्ते",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(d, 512)
    return Tokenizer.from_pretrained(d)


def _stream(tok, prompt_ids, ids, skip=True):
    det = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = []
    for i, t in enumerate(ids):
        delta = det.add(t)
        assert "\ufffd" not in delta or "\ufffd" in tok.decode(ids[: i + 1], skip_special_tokens=skip)
        deltas.append(delta)
        full = tok.decode(ids[: i + 1], skip_special_tokens=skip)
        if not full.endswith("\ufffd"):
            assert det.text == full, (i, det.text, full)
        else:
            assert full.startswith(det.text)
        assert "".join(deltas) == det.text
    return det, deltas


@pytest.mark.parametrize("text", MULTIBYTE)
def test_incremental_equals_full_decode_on_every_prefix(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Say something:")
    det, deltas = _stream(tok, prompt, ids)
    assert det.text == text and det.token_ids == ids
    assert "" in deltas, "no token split a character: the hold-back path was not exercised"
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok):
    body = tok.encode("你好 🦄", add_special_tokens=False)
    ids = body[:2] + [tok.token_to_id(USER_TOKEN)] + body[2:] + [tok.eos_token_id]
    det, _ = _stream(tok, [tok.bos_token_id], ids, skip=True)
    assert det.text == "你好 🦄"
    det, _ = _stream(tok, [tok.bos_token_id], ids, skip=False)
    assert det.text == tok.decode(ids, skip_special_tokens=False)
    assert USER_TOKEN in det.text and det.text.endswith(EOS_TOKEN)


def test_random_token_streams(tok):
    r = random.Random(0)
    for _ in range(30):
        ids = [r.randrange(tok.vocab_size) for _ in range(r.randrange(1, 25))]
        prompt = [r.randrange(tok.vocab_size) for _ in range(r.randrange(0, 8))]
        for skip in (True, False):
            det, _ = _stream(tok, prompt, ids, skip)
            full = tok.decode(ids, skip_special_tokens=skip)
            if not full.endswith("\ufffd"):
                assert det.text == full


# ------------------------------------------------------------------ stop checker


def _feed_all(checker, deltas):
    emitted, matched = [], None
    for d in deltas:
        out, m = checker.feed(d)
        emitted.append(out)
        if m is not None:
            matched = m
            break
    if matched is None:
        emitted.append(checker.flush())
    return emitted, matched


def test_stop_split_across_deltas():
    c = StopChecker(["STOP"], include_stop_str_in_output=False)
    assert c.feed("Hello ST") == ("Hello ", None)
    assert c.feed("O") == ("", None)
    assert c.feed("P and more") == ("", "STOP")
    assert c.done and c.feed("x") == ("", None)


def test_stop_included_in_output():
    c = StopChecker(["</s>"], include_stop_str_in_output=True)
    emitted, matched = _feed_all(c, ["ab<", "/", "s>cd"])
    assert "".join(emitted) == "ab</s>" and matched == "</s>"


def test_false_alarm_released_and_flush():
    c = StopChecker(["<end>"], include_stop_str_in_output=False)
    assert c.feed("x <e") == ("x ", None)
    assert c.feed("nx") == ("<enx", None)
    assert c.feed(" tail <en") == (" tail ", None)
    assert c.flush() == "<en"
    assert c.flush() == ""


def test_overlapping_prefixes_and_earliest_match():
    c = StopChecker(["abcd", "bcx"])
    emitted, matched = _feed_all(c, ["a", "b", "c", "x", "yz"])
    assert "".join(emitted) == "a" and matched == "bcx"
    # two stop strings in one delta: the earliest wins
    c = StopChecker(["world", "lo"])
    assert c.feed("hello world") == ("hel", "lo")
    # same start: the longer one is reported
    c = StopChecker(["ab", "abc"], include_stop_str_in_output=True)
    assert c.feed("xabcd") == ("xabc", "abc")
    # a stop string inside a longer held prefix: "aab" with stop "ab" after holding "a"
    c = StopChecker(["ab"])
    assert c.feed("a") == ("", None)
    assert c.feed("a") == ("a", None)
    assert c.feed("b") == ("", "ab")


def test_stop_checker_matches_whole_text_reference():
    r = random.Random(1)
    alphabet = "abc你😀"
    for _ in range(300):
        stops = ["".join(r.choice(alphabet) for _ in range(r.randrange(1, 4))) for _ in range(r.randrange(1, 3))]
        text = "".join(r.choice(alphabet) for _ in range(r.randrange(0, 20)))
        cuts = sorted(r.sample(range(len(text) + 1), min(len(text) + 1, r.randrange(1, 6))))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        include = r.random() < 0.5
        c = StopChecker(stops, include)
        emitted, matched = _feed_all(c, deltas)
        out = "".join(emitted)
        # reference on the whole text: the first delta after which some stop string occurs,
        # then the earliest occurrence in all text so far (the longest on equal starts)
        ref_out, ref_match = text, None
        for k in range(1, len(deltas) + 1):
            so_far = "".join(deltas[:k])
            hits = [(so_far.find(s), -len(s), s) for s in stops if s in so_far]
            if hits:
                i, _, s = min(hits)
                ref_out, ref_match = so_far[:i] + (s if include else ""), s
                break
        assert (out, matched) == (ref_out, ref_match), (stops, deltas)
        if not include:
            assert not any(s in out for s in stops), (stops, deltas, out)


def test_stop_checker_rejects_empty_strings():
    with pytest.raises(InvalidRequestError, match="stop"):
        StopChecker(["ok", ""], False)
