"""Losslessness of the acceptance rules: emitted tokens follow the target pmf exactly.

Chi-square against the exact target pmf over n >= 10^6 emitted-token draws per case, random (p, q)
over vocabularies of 10 to 1000 and draft lengths 1..5; the target at each slot is fixed (it does not
depend on the prefix), so the token emitted at slot j, given that the step reaches slot j, must follow
p_j. Every case is one vectorised call (rows are expanded views of one (p, q)); seeds differ per row.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from deepinfer.spec.rejection import (
    STREAM_DRAFT,
    draw_from_rows,
    greedy_verify,
    rejection_verify,
    spec_keys,
    uniforms,
)

N = 1_000_000
ALPHA = 1e-4  # false-alarm rate per check; a biased rule fails at p-values far below it


def chi2_pvalue(counts: torch.Tensor, pmf: torch.Tensor) -> float:
    """Pearson chi-square p-value; bins with expected count < 5 are pooled into one."""
    n = counts.sum().item()
    exp = pmf.to(torch.float64) * n
    big = exp >= 5
    obs_b = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp_b = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp_b > 0
    obs_b, exp_b = obs_b[keep], exp_b[keep]
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    return float(chi2.sf(stat, max(1, obs_b.numel() - 1)))


def random_pmf(g: torch.Generator, shape, vocab: int, sharp: float) -> torch.Tensor:
    logits = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * sharp
    # some exact zeros, as top-k / top-p leave
    mask = torch.rand(*shape, vocab, generator=g) < 0.2
    mask[..., 0] = False
    return torch.where(mask, torch.tensor(float("-inf"), dtype=torch.float64), logits).softmax(-1)


def draw_drafts(q: torch.Tensor, n: int, seeds: torch.Tensor, first_pos: int) -> torch.Tensor:
    """[n, K] drafts drawn from q [K, V] with the drafter's own stream."""
    k = q.shape[0]
    out = torch.empty(n, k, dtype=torch.int64)
    for j in range(k):
        u = uniforms(seeds, torch.full_like(seeds, first_pos + j), STREAM_DRAFT)
        out[:, j] = draw_from_rows(q[j : j + 1], torch.zeros(n, dtype=torch.int64), u)
    return out


def emitted_counts(verdict, k: int, vocab: int) -> list[torch.Tensor]:
    """Per slot j: counts of the tokens emitted at j by rows that reached j."""
    out = []
    for j in range(k + 1):
        reach = verdict.num_accepted >= j
        out.append(torch.bincount(verdict.tokens[reach, j], minlength=vocab))
    return out


def test_keys_match_sampler_and_streams_differ():
    from deepinfer.sample.rng import _signed, row_key

    s, p = torch.tensor([0, 7, -5, 2**62]), torch.tensor([0, 3, 9, 12345])
    assert spec_keys(s, p, 0).tolist() == [_signed(row_key(a, b)) for a, b in zip(s.tolist(), p.tolist())]
    k1, k2 = spec_keys(s, p, 1), spec_keys(s, p, 2)
    assert not bool((k1 == k2).any()) and not bool((k1 == spec_keys(s, p, 0)).any())


def test_fixed_point_inverse_cdf_matches_pmf():
    g = torch.Generator().manual_seed(0)
    pmf = random_pmf(g, (), 50, 1.5)
    seeds = torch.arange(N // 4)
    rows = torch.zeros(N // 4, dtype=torch.int64)
    tok = draw_from_rows(pmf.unsqueeze(0), rows, uniforms(seeds, torch.zeros_like(seeds), 5))
    assert chi2_pvalue(torch.bincount(tok, minlength=50), pmf) > ALPHA


@pytest.mark.parametrize("vocab,k,deterministic", [(10, 4, False), (100, 3, True), (1000, 2, False),
                                                   (1000, 5, True)])
def test_rejection_is_lossless(vocab, k, deterministic):
    g = torch.Generator().manual_seed(vocab * 10 + k)
    p = random_pmf(g, (k + 1,), vocab, 1.5)
    q = random_pmf(g, (k,), vocab, 1.0)
    n = N
    seeds = torch.randint(-2**62, 2**62, (n,), generator=g)
    pos0 = 17
    if deterministic:
        # a deterministic drafter: its token is a fixed function of the context (here: per slot, a
        # token chosen adversarially with low target probability half the time)
        order = p[:k].argsort(dim=-1)
        draft = torch.where((seeds % 2 == 0).unsqueeze(1), order[:, 0].expand(n, -1), order[:, -1].expand(n, -1))
        qq = None
    else:
        draft = draw_drafts(q, n, seeds, pos0)
        qq = q
    lens = torch.randint(0, k + 1, (n,), generator=g)  # variable-length drafts, 0 included
    # every row uses the same k+1 target rows and k draft rows (indexed, not copied per row)
    p_rows = torch.arange(k + 1).expand(n, -1)
    q_rows = None if qq is None else torch.arange(k).expand(n, -1)
    v = rejection_verify(p, draft, lens, seeds, torch.full((n,), pos0), qq, p_rows=p_rows, q_rows=q_rows)
    assert bool((v.num_accepted <= lens).all())
    total = 0
    for j, counts in enumerate(emitted_counts(v, k, vocab)):
        total += int(counts.sum())
        if counts.sum() > 1000:
            assert chi2_pvalue(counts, p[j]) > ALPHA, f"slot {j}"
    assert total >= N


def test_batch_invariant_rows():
    """A row's result does not depend on the other rows of its batch (its slice of a batch == alone)."""
    g = torch.Generator().manual_seed(3)
    p, q = random_pmf(g, (8, 4), 30, 1.2), random_pmf(g, (8, 3), 30, 1.0)
    draft = torch.randint(0, 30, (8, 3), generator=g)
    lens, seeds, pos = torch.tensor([3, 0, 2, 1, 3, 3, 2, 1]), torch.arange(8) * 77, torch.arange(8) + 5
    full = rejection_verify(p, draft, lens, seeds, pos, q)
    for i in range(8):
        one = rejection_verify(p[i : i + 1], draft[i : i + 1], lens[i : i + 1], seeds[i : i + 1], pos[i : i + 1],
                               q[i : i + 1])
        assert one.num_accepted.item() == full.num_accepted[i].item()
        assert torch.equal(one.tokens[0, : one.num_accepted.item() + 1], full.tokens[i, : full.num_accepted[i] + 1])


def test_greedy_verify():
    tgt = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    draft = torch.tensor([[5, 6, 7], [5, 0, 7], [1, 2, 3], [9, 9, 9]])
    lens = torch.tensor([3, 3, 2, 0])
    v = greedy_verify(tgt, draft, lens)
    assert v.num_accepted.tolist() == [3, 1, 2, 0]
    assert v.tokens[0].tolist() == [5, 6, 7, 8]
    assert v.tokens[1, :2].tolist() == [5, 6]
    assert v.tokens[2, :3].tolist() == [1, 2, 3]
    assert v.tokens[3, :1].tolist() == [9]
