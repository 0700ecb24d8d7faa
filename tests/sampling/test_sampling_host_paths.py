"""Host fast paths kept equal to the plain ones: stray-byte detokenization, sampler filter flags."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.checkpoints.tokenizer_factory import write_tokenizer
from deepinfer.sample.sampler import filter_logits
from deepinfer.text.detokenizer import _MAX_HELD, IncrementalDetokenizer
from deepinfer.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok_host"))
    write_tokenizer(d, 1024)
    return Tokenizer.from_pretrained(d)


def _stray(tok) -> list[int]:
    """Tokens that decode to U+FFFD alone (single bytes >= 0x80)."""
    ids = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    assert len(ids) > 50
    return ids


def test_stray_bytes_are_emitted_and_the_window_stays_bounded(tok):
    b = _stray(tok)[0]
    det = IncrementalDetokenizer(tok, [65, 66])
    for n in range(1, 400):
        det.add(b)
        assert len(det._ids) - det._prefix_offset <= 2 * _MAX_HELD + 2, f"window grew to {len(det._ids)} at {n}"
    assert det.text == "\ufffd" * len(det.text) and len(det.text) >= 399 - _MAX_HELD
    a = tok.encode("A")[-1]
    det.add(a)
    assert det.text == tok.decode([b] * 399 + [a])


@pytest.mark.parametrize("p_stray", [0.3, 0.7, 0.95])
def test_mixed_streams_match_the_whole_decode(tok, p_stray):
    """Random mixes of stray bytes, multi-byte pieces and text: the streamed text is always a
    prefix of decoding everything, and equal to it once a plain token ends the stream."""
    stray = _stray(tok)
    end = tok.encode("Z")[-1]
    rng = random.Random(int(p_stray * 100))
    for _ in range(150):
        ids = [rng.choice(stray) if rng.random() < p_stray else rng.randrange(8, tok.vocab_size)
               for _ in range(rng.randrange(1, 120))]
        det = IncrementalDetokenizer(tok, [65, 66])
        for i, t in enumerate(ids):
            det.add(t)
            assert tok.decode(ids[: i + 1]).startswith(det.text)
        det.add(end)
        assert det.text == tok.decode(ids + [end])


def test_filter_flags_from_the_host_equal_the_inferred_ones():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    top_k = torch.tensor([300, 5, 300, 300, 40, 300])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 0.5, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    ref = filter_logits(logits, top_k, top_p, min_p)
    assert torch.equal(filter_logits(logits, top_k, top_p, min_p, use_sort=True, use_min_p=True), ref)
    off = torch.full((6,), 300), torch.ones(6), torch.zeros(6)
    assert torch.equal(filter_logits(logits, *off, use_sort=False, use_min_p=False), logits)
    assert torch.equal(filter_logits(logits, *off), logits)
