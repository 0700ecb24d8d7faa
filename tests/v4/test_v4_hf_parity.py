"""tiny-v4 (W=8, CSA m=4, HCA m=16, 8 indexer heads, top-k 4) against transformers' deepseek_v4, fp32.

The reference runs one sequence at a time (it is not padding-safe); our side
runs many requests in one mixed batch over the paged hybrid cache, so every
test also checks that requests at different compression phases do not
disturb each other.
"""

from __future__ import annotations

import pytest
import torch
from v4_helpers import PagedRunner, hf_logits

ATOL = 2e-5  # logits are O(10); observed max error ~9e-6 (fp32 reorderings)

# around every boundary: 1, 3-5, W-1..W+1, multiples of 4 and 16 +-1, past YaRN's original 64, >= 200
PREFILL_LENGTHS = [1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 211]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 1024, (n,), generator=g).tolist()


def _run_schedule(model, prompts: dict[int, list[int]], plan) -> dict[int, torch.Tensor]:
    """plan(rid, done) -> number of tokens request rid feeds next; all live requests share each step."""
    r = PagedRunner(model, block_size=4, num_blocks=1024, max_seqs=len(prompts))
    done = {rid: 0 for rid in prompts}
    outs: dict[int, list[torch.Tensor]] = {rid: [] for rid in prompts}
    for rid in prompts:
        r.add(rid)
    while any(done[rid] < len(p) for rid, p in prompts.items()):
        chunks = []
        for rid, p in prompts.items():
            if done[rid] < len(p):
                n = min(plan(rid, done[rid]), len(p) - done[rid])
                chunks.append((rid, p[done[rid] : done[rid] + n]))
        logits = r.step(chunks)
        row = 0
        for rid, toks in chunks:
            outs[rid].append(logits[row : row + len(toks)])
            row += len(toks)
            done[rid] += len(toks)
    assert r.freed_swa > 0  # the sliding window really dropped old blocks
    return {rid: torch.cat(v) for rid, v in outs.items()}


def test_prefill_logits_match_reference(hf_model, our_model):
    prompts = {i: _prompt(n, seed=n) for i, n in enumerate(PREFILL_LENGTHS)}
    ours = _run_schedule(our_model, prompts, lambda rid, done: 10**6)
    for rid, p in prompts.items():
        ref = hf_logits(hf_model, p)
        torch.testing.assert_close(ours[rid], ref, atol=ATOL, rtol=0, msg=f"prompt length {len(p)}")


def test_prefill_then_decode_equals_full_forward_at_every_split(hf_model, our_model):
    n = 40  # crosses W=8, m=4 and m=16 boundaries several times
    ids = _prompt(n, seed=123)
    ref = hf_logits(hf_model, ids)
    prompts = {s: ids for s in range(1, n)}  # request s: prefill s tokens, then one token per step
    ours = _run_schedule(our_model, prompts, lambda rid, done: rid if done == 0 else 1)
    for s, got in ours.items():
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=f"split at {s}")


def test_long_decode_past_yarn_original_length(hf_model, our_model):
    ids = _prompt(230, seed=7)
    ref = hf_logits(hf_model, ids)
    ours = _run_schedule(our_model, {0: ids}, lambda rid, done: 190 if done == 0 else 1)
    torch.testing.assert_close(ours[0], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [(3, 5, 7, 9, 11, 13), (1, 2, 6, 10, 17, 30)])
def test_chunked_prefill_matches_full_forward(hf_model, our_model, chunks):
    """Chunk sizes coprime to W=8 and the rates (and a second set that lands on every phase)."""
    ids = _prompt(101, seed=99)
    ref = hf_logits(hf_model, ids)
    prompts = {c: ids for c in chunks}
    ours = _run_schedule(our_model, prompts, lambda rid, done: rid)
    for c, got in ours.items():
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=f"chunk size {c}")


def test_preemption_and_recompute_with_a_reused_state_row(hf_model, our_model):
    """A request is dropped mid-decode, its state row and blocks are reused by another, then it recomputes."""
    a, b = _prompt(57, seed=1), _prompt(45, seed=2)
    ref_a, ref_b = hf_logits(hf_model, a), hf_logits(hf_model, b)
    r = PagedRunner(our_model, block_size=4, num_blocks=256, max_seqs=1)
    r.add(0)
    first = [r.step([(0, a[:21])])]
    for t in range(21, 30):
        first.append(r.step([(0, [a[t]])]))
    torch.testing.assert_close(torch.cat(first), ref_a[:30], atol=ATOL, rtol=0)
    r.release(0)  # preempted: blocks and the only state row go to request 1
    r.add(1)
    got_b = [r.step([(1, b[:13])]), r.step([(1, b[13:45])])]
    torch.testing.assert_close(torch.cat(got_b), ref_b, atol=ATOL, rtol=0)
    r.release(1)
    r.add(0)  # recompute: prompt + the tokens generated before preemption, in uneven chunks
    redo = [r.step([(0, a[:11])]), r.step([(0, a[11:30])])]
    for t in range(30, 57):
        redo.append(r.step([(0, [a[t]])]))
    torch.testing.assert_close(torch.cat(redo), ref_a, atol=ATOL, rtol=0)
