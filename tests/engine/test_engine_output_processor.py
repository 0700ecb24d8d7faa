"""Output processing: stop strings, stop token ids, EOS / ignore_eos, min_tokens, max_tokens,
max_model_len and logprobs, fed token by token with the real byte-level tokenizer."""

from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.outputs import Logprob
from deepinfer.sched.request import Request, Sequence
from deepinfer.text.output_processor import OutputProcessor
from deepinfer.text.tokenizer import Tokenizer

EOS = 1


@pytest.fixture(scope="module")
def tok(fake_tokenizer_dir):
    return Tokenizer.from_pretrained(fake_tokenizer_dir)


def run(tok, text_or_ids, max_model_len=1000, **params):
    proc = OutputProcessor(tok, {EOS}, max_model_len)
    req = Request("r", None, [0, 5, 6], SamplingParams(**params))
    seq = Sequence("r#0", req, 0, seed=0)
    req.seqs.append(seq)
    proc.init_seq(seq)
    ids = tok.encode(text_or_ids, add_special_tokens=False) if isinstance(text_or_ids, str) else text_or_ids
    for t in ids:
        proc.append_token(seq, t, {t: Logprob(t, -0.5, rank=1)} if params.get("logprobs") is not None else None)
        if seq.finished:
            break
    return seq, proc.make_output(req)


def test_plain_text_is_cumulative_and_length_finish(tok):
    text = "Hello, 世界! The cat sat."
    ids = tok.encode(text, add_special_tokens=False)
    seq, out = run(tok, ids, max_tokens=len(ids))
    assert out.text == text and out.token_ids == ids and out.finish_reason == "length" and out.finished


def test_stop_string_cut_and_included(tok):
    seq, out = run(tok, "one two STOP three four", max_tokens=100, stop=["STOP"])
    assert out.text == "one two " and out.finish_reason == "stop" and out.outputs[0].stop_reason == "STOP"
    seq, out = run(tok, "one two STOP three four", max_tokens=100, stop=["STOP"], include_stop_str_in_output=True)
    assert out.text == "one two STOP"


def test_held_back_text_is_flushed_when_no_stop_matches(tok):
    text = "abc ST"
    ids = tok.encode(text, add_special_tokens=False)
    seq, out = run(tok, ids, max_tokens=len(ids), stop=["STOP"])
    assert out.text == text and out.finish_reason == "length"


def test_eos_stops_unless_ignored_and_respects_min_tokens(tok):
    ids = tok.encode("hi there", add_special_tokens=False)
    seq, out = run(tok, ids + [EOS] + ids, max_tokens=50)
    assert out.finish_reason == "stop" and out.token_ids == ids + [EOS] and out.text == "hi there"
    assert out.outputs[0].stop_reason is None
    seq, out = run(tok, ids + [EOS] + ids, max_tokens=50, ignore_eos=True)
    assert out.finish_reason is None and len(out.token_ids) == 2 * len(ids) + 1
    seq, out = run(tok, [EOS] + ids + [EOS], max_tokens=50, min_tokens=len(ids) + 1)
    assert out.finish_reason == "stop" and len(out.token_ids) == len(ids) + 2


def test_stop_token_ids(tok):
    ids = tok.encode("a b c d", add_special_tokens=False)
    seq, out = run(tok, ids, max_tokens=50, stop_token_ids=[ids[2]])
    assert out.token_ids == ids[:3] and out.finish_reason == "stop" and out.outputs[0].stop_reason == ids[2]
    assert out.text == tok.decode(ids[:2])


def test_max_model_len_ends_with_length(tok):
    ids = tok.encode("a b c d e f g", add_special_tokens=False)
    seq, out = run(tok, ids, max_model_len=3 + 4, max_tokens=100)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_logprobs_accumulate_with_decoded_text(tok):
    ids = tok.encode("hello world", add_special_tokens=False)
    seq, out = run(tok, ids, max_tokens=len(ids), logprobs=0)
    lps = out.outputs[0].logprobs
    assert len(lps) == len(ids) and all(ids[i] in lps[i] for i in range(len(ids)))
    assert "".join(lps[i][ids[i]].decoded for i in range(len(ids))) == "hello world"


DEFERRED_CASES = {
    "length": ("Hello, 世界! The cat sat. 🙂 ok", {}, {"max_tokens": 9}),
    "eos": ("hi there", [EOS], {"max_tokens": 50}),
    "eos-included": ("hi there", [EOS], {"max_tokens": 50, "include_stop_str_in_output": True}),
    "eos-before-min-tokens": ("a", [EOS], {"max_tokens": 50, "min_tokens": 4}),
    "stop-token-id": ("a b c d e", None, {"max_tokens": 50}),
    "stop-token-id-included": ("a b c d e", None, {"max_tokens": 50, "include_stop_str_in_output": True}),
    "max-model-len": ("a b c d e f g h", [], {"max_tokens": 100}),
    "logprobs": ("naïve café", [], {"max_tokens": 50, "logprobs": 0}),
}


def _feed(tok, ids, proc, seq, defer: bool, flush_every: int) -> None:
    for i, t in enumerate(ids):
        lp = {t: Logprob(t, -0.5, rank=1)} if seq.params.logprobs is not None else None
        proc.append_token(seq, t, lp, defer_text=defer)
        if defer and (i + 1) % flush_every == 0:
            proc.flush_text(seq)
        if seq.finished:
            break
    proc.flush_text(seq)


@pytest.mark.parametrize("case", list(DEFERRED_CASES))
@pytest.mark.parametrize("flush_every", [1, 3, 100])
def test_deferred_text_equals_immediate_text(tok, case, flush_every):
    """append_token(defer_text=True) applies every stop condition at once and queues the text; flush_text (after
    every token, every 3, or once at the end) gives the immediate path's text, finish and stop reasons, token ids
    and logprobs with their decoded text (spec/overlap.py overlaps it with the next step)."""
    text, tail, params = DEFERRED_CASES[case]
    ids = tok.encode(text, add_special_tokens=False)
    if case.startswith("stop-token-id"):
        params = dict(params, stop_token_ids=[ids[3]])
    ids = ids + list(tail or []) + ids
    outs = []
    for defer in (False, True):
        proc = OutputProcessor(tok, {EOS}, 3 + 6 if case == "max-model-len" else 1000)
        req = Request("r", None, [0, 5, 6], SamplingParams(**params))
        seq = Sequence("r#0", req, 0, seed=0)
        req.seqs.append(seq)
        proc.init_seq(seq)
        _feed(tok, ids, proc, seq, defer, flush_every)
        assert seq.pending_text == []
        out = proc.make_output(req).outputs[0]
        lps = [{t: (lp.logprob, lp.decoded) for t, lp in d.items()} for d in out.logprobs] if out.logprobs else None
        outs.append((out.text, out.token_ids, out.finish_reason, out.stop_reason, lps))
    assert outs[0] == outs[1]
    assert outs[1][0] or case == "eos-before-min-tokens"  # (the cases make text)


def test_a_sequence_with_stop_strings_is_never_deferred(tok):
    """A stop string can end the sequence, which the next step's schedule must know: its text is made at once."""
    proc = OutputProcessor(tok, {EOS}, 1000)
    req = Request("r", None, [0, 5, 6], SamplingParams(max_tokens=100, stop=["STOP"]))
    seq = Sequence("r#0", req, 0, seed=0)
    req.seqs.append(seq)
    proc.init_seq(seq)
    for t in tok.encode("one two STOP three", add_special_tokens=False):
        proc.append_token(seq, t, None, defer_text=True)
        assert seq.pending_text == []
        if seq.finished:
            break
    assert seq.finished and seq.text == "one two " and seq.stop_reason == "STOP"
