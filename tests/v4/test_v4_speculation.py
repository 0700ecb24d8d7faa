"""Speculative decoding on V4 (n-gram drafts here; MTP drafts: test_v4_mtp.py): a verify step runs 1 + k tokens of a
sequence as one chunk, writing the sliding window, the compressed entries and the compressors' rings for every one,
and the rejected drafts are rolled back (KVCacheManager.rollback: the window's blocks by window_rollback_tokens, the
rings by state_rollback_tokens, rings built k positions longer: v4_kv_cache_specs ring_margin).

- the ring property itself, against positions' true projections, with the negative control (no margin: a rollback
  reads slots the rejected drafts overwrote);
- the engine on tiny-v4 (fp32): greedy output with speculation == without, with every acceptance length 0..k
  occurring, under chunked prefill, with prefix-cache hits (their ring snapshots taken in speculative steps),
  with preemption, and adaptive; every block back at the end;
- the refusals: a window margin below k; a rollback past the rings' margin.
"""

from __future__ import annotations

import pytest
import torch
from v4_helpers import engine as _engine
from v4_helpers import off_prompts

from deepinfer import SamplingParams
from deepinfer.backend import KVCacheSpec
from deepinfer.backend.native.v4_compressor import first_needed_position, gather_projections, ring_len, update_ring
from deepinfer.errors import ConfigError, DeepInferError
from deepinfer.kv.manager import KVCacheManager
from deepinfer.spec.ngram import NgramDrafter, NgramProposal

K = 4


@pytest.mark.parametrize("rate,overlap", [(4, True), (16, False)])
def test_ring_margin_keeps_what_a_rollback_reads(rate, overlap):
    """A ring written by verify steps of 1 + k positions, then rolled back to the accepted ones, must still hold
    the true projections of every position the compressor reads at the rolled-back length. With ring_len + k
    slots it does for every k <= 5 and acceptance; with ring_len slots it does not (the negative control)."""
    g = torch.Generator().manual_seed(rate)
    width = 3
    true = torch.randn(400, width, generator=g)
    gates = torch.randn(400, width, generator=g)
    for margin, must_hold in ((None, True), (0, False)):
        broke = False
        for k in range(1, 6):
            size = ring_len(rate, overlap) + (k if margin is None else margin)
            ring = torch.zeros(size, 2 * width)
            c, step = 0, 0
            while c < 300:
                n, step = 1 + k, step + 1
                accepted = (step * 5 + k) % (k + 1)  # 0..k drafts accepted
                kv = true[c : c + n].clone()
                gate = gates[c : c + n].clone()
                kv[1 + accepted :] += 100.0  # the rejected drafts' projections: not the true ones
                update_ring(ring, c, kv, gate)
                c += 1 + accepted  # rolled back to the accepted tokens
                base = first_needed_position(c, rate, overlap)
                got, _, got_base = gather_projections(ring, c, true[c:c], gates[c:c], rate, overlap)
                assert got_base == base
                same = torch.equal(got, true[base:c])
                if must_hold:
                    assert same, (k, c)
                broke = broke or not same
        assert must_hold or broke  # without the margin some rollback read a rejected draft's slot


class OracleDrafter(NgramDrafter):
    """Drafts the speculation-off run's own continuation, right for the first (position * 7 + 3) mod (k + 2)
    tokens and wrong after (so every acceptance length 0..k occurs): the random tiny-v4 never repeats itself, so
    prompt lookup would draft nothing it accepts. An n-gram drafter to the pipeline (host proposals)."""

    def __init__(self, references: list[list[int]]):
        super().__init__()
        self.references = references

    def propose(self, tokens: list[int], k: int) -> NgramProposal:
        for ref in self.references:
            if len(ref) > len(tokens) and ref[: len(tokens)] == tokens:
                nxt = ref[len(tokens) : len(tokens) + k]
                right = (len(tokens) * 7 + 3) % (k + 2)
                out = [t if j < right else (t + 1) % 1000 + 2 for j, t in enumerate(nxt)]
                return NgramProposal(out, [0.9] * len(out))
        return NgramProposal([], [])


@pytest.fixture(scope="module")
def off_run(tiny_dir):
    prompts = off_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = _engine(tiny_dir, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    return prompts, params, [o.outputs[0].token_ids for o in outs]


def _speculate(tiny_dir, off_run, runs: int = 1, **kw):
    prompts, params, want = off_run
    engine = _engine(tiny_dir, speculative_method="ngram", num_speculative_tokens=K, **kw)
    engine._spec.drafter = OracleDrafter([p + w for p, w in zip(prompts, want)])  # (the test's drafter)
    for _ in range(runs):
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert got == want
    return engine.stats()


def test_v4_speculation_equals_off_with_every_acceptance_length(tiny_dir, off_run):
    """Chunked prefill (13 tokens a step: chunks at every phase of W = 8, m = 4, m = 16), drafts of 4 accepted
    0..4 at a time; run twice, the second run's prompts hit the prefix cache (V4's snapshots of the rings at
    block boundaries, written by speculative steps too)."""
    st = _speculate(tiny_dir, off_run, runs=2, num_kv_blocks=256, max_num_batched_tokens=13)
    assert 0 < st.spec_accepted_tokens < st.spec_drafted_tokens
    cond = st.spec_conditional_acceptance
    assert len(cond) == K and all(0.0 < a < 1.0 for a in cond[:2]), cond  # accepted and rejected at each depth
    assert st.prefix_cache_hit_tokens > 0 and st.kv_blocks_used == 0


def test_v4_speculation_under_preemption_and_adaptive(tiny_dir, off_run):
    """A pool so small that sequences are preempted and recomputed mid-run; and the adaptive scheduler (its step
    costs profiled as varlen verify rows: V4 never runs them as decode rows)."""
    st = _speculate(tiny_dir, off_run, num_kv_blocks=14)
    assert st.num_preemptions > 0 and st.spec_accepted_tokens > 0 and st.kv_blocks_used == 0
    st = _speculate(tiny_dir, off_run, num_kv_blocks=256, speculative_adaptive=True)
    assert 0 < st.spec_accepted_tokens < st.spec_drafted_tokens


def test_a_window_margin_below_k_is_refused(tiny_dir):
    with pytest.raises(ConfigError, match="kv_window_rollback_tokens=2 .* below num_speculative_tokens=4"):
        _engine(tiny_dir, speculative_method="ngram", num_speculative_tokens=K, kv_window_rollback_tokens=2,
                num_kv_blocks=64)


def test_state_rollback_within_the_rings_margin_only():
    """A group with per-sequence state rolls back by at most state_rollback_tokens (what its rings were built
    for), and by nothing without a margin; the error names the setting."""
    spec = KVCacheSpec("comp", (0,), (4,), torch.float32, tokens_per_entry=4, state_shape=(8 + K, 6))

    class Seq:
        seq_id, num_computed_tokens = "a", 0

    for margin in (0, K):
        kv = KVCacheManager([spec], {"comp": 32}, 4, 2, 256, state_rollback_tokens=margin)
        s = Seq()
        kv.allocate(s, 20)
        s.num_computed_tokens = 20
        kv.allocate(s, 1 + K)  # a verify step
        if margin:
            kv.rollback(s, 21)  # the bonus token only: K tokens back
        else:
            with pytest.raises(DeepInferError, match="state_rollback_tokens=0"):
                kv.rollback(s, 21)
    with pytest.raises(DeepInferError, match="state_rollback_tokens"):
        KVCacheManager([spec], {"comp": 32}, 4, 2, 256, state_rollback_tokens=-1)
    kv = KVCacheManager([spec], {"comp": 32}, 4, 2, 256, state_rollback_tokens=K)
    s = Seq()
    kv.allocate(s, 25)
    with pytest.raises(DeepInferError, match="rollback of 5 tokens"):
        kv.rollback(s, 20)
