"""The lightning indexer's selected set against transformers' DeepseekV4Indexer (8 heads, fp32).

Sets must be equal up to ties (entries whose score equals the k-th score),
including the causal bound ((t + 1) // m) and top-k larger than the entries
available. Ties are ours to break: lowest entry index first, so a query's
choice never depends on how many later entries exist.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.backend.native.v4_compressor import compress_windows
from deepinfer.backend.native.v4_indexer import causal_entry_mask, indexer_scores, select_topk
from deepinfer.backend.native.v4_rope import apply_v4_rope
from deepinfer.checkpoints.presets_v4 import tiny_v4_config
from deepinfer.models.deepseek_v4.attention import RopeTable
from deepinfer.models.deepseek_v4.config import parse_v4_config

hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _setup(topk: int, L: int, seed: int = 0):
    from transformers import DeepseekV4Config

    raw = {**tiny_v4_config(), "index_topk": topk}
    hf_cfg = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("architectures", "compress_ratios")})
    idx = hf_v4.DeepseekV4Indexer(hf_cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in idx.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 or p.shape[0] == 4 else p.shape[-1] ** -0.5))
    h = torch.randn(L, hf_cfg.hidden_size, generator=g)
    q_res = torch.randn(L, hf_cfg.q_lora_rank, generator=g)
    return hf_cfg, parse_v4_config(raw), idx, h, q_res


def _ours(cfg, idx, h, q_res):
    m, Hi, Di, L = cfg.compress_rates["compressed_sparse_attention"], cfg.index_n_heads, cfg.index_head_dim, h.shape[0]
    rope = RopeTable(cfg.rope_compress, torch.float32)
    pos = torch.arange(L)
    keys = compress_windows(F.linear(h, idx.kv_proj.weight), F.linear(h, idx.gate_proj.weight), 0, 0, L // m, m, True,
                            idx.position_bias.detach(), idx.kv_norm.weight.detach(), cfg.rms_norm_eps,
                            rope.inv_freq, 1.0)
    cos, sin = rope(pos)
    q = apply_v4_rope(F.linear(q_res, idx.q_b_proj.weight).view(L, Hi, Di), cos, sin)
    w = F.linear(h, idx.scorer.weights_proj.weight) * Hi**-0.5
    scores = indexer_scores(q, keys, w, Di**-0.5)
    visible = causal_entry_mask(pos, keys.shape[0], m)
    return scores, visible, select_topk(scores, visible, cfg.index_topk)


@pytest.mark.parametrize("topk,L", [(4, 61), (3, 200), (64, 61)])
def test_selected_sets_match_reference(topk, L):
    _, cfg, idx, h, q_res = _setup(topk, L)
    with torch.no_grad():
        ref = idx(h[None], q_res[None], torch.arange(L)[None], None, 0)[0]
        scores, visible, chosen = _ours(cfg, idx, h, q_res)
    m = cfg.compress_rates["compressed_sparse_attention"]
    for t in range(L):
        n_visible = (t + 1) // m
        theirs = {int(i) for i in ref[t] if i >= 0}
        mine = set(torch.nonzero(chosen[t]).flatten().tolist())
        assert all(e < n_visible for e in mine), f"query {t} picked a future entry"
        assert len(mine) == min(topk, n_visible)
        if topk >= n_visible:
            assert mine == set(range(n_visible))
        diff = mine ^ theirs
        if diff:  # only ties may differ: every differing entry scores exactly the k-th best score
            kth = scores[t][visible[t]].sort(descending=True).values[len(mine) - 1]
            assert all(abs(float(scores[t, e] - kth)) < 1e-6 for e in diff), f"query {t}: {mine} vs {theirs}"


def test_scores_match_reference_scorer():
    _, cfg, idx, h, q_res = _setup(4, 40)
    with torch.no_grad():
        scores, _, _ = _ours(cfg, idx, h, q_res)
        m, Hi, Di = 4, cfg.index_n_heads, cfg.index_head_dim
        # the reference's own compressed keys and rotated queries, through its scorer
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        rot = idx.rotary_emb
        kv, gate = idx.kv_proj(h[None]), idx.gate_proj(h[None])
        keys = compress_windows(kv[0], gate[0], 0, 0, 10, m, True, idx.position_bias, idx.kv_norm.weight, 1e-6,
                                rot.compress_inv_freq, 1.0)
        cos, sin = rot(h[None], torch.arange(40)[None], layer_type="compress")
        q = apply_rotary_pos_emb(idx.q_b_proj(q_res[None]).view(1, 40, Hi, Di).transpose(1, 2), cos, sin).transpose(1, 2)
        ref = idx.scorer(q, keys[None], h[None])[0]
    torch.testing.assert_close(scores, ref, atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_lowest_index_and_stay_causal():
    scores = torch.zeros(12, 20)
    scores[:, 5] = 1.0
    pos = torch.arange(12) * 4 + 3  # query t sees entries < t + 1
    short = select_topk(scores[:, :8], causal_entry_mask(pos, 8, 4), 3)
    long = select_topk(scores, causal_entry_mask(pos, 20, 4), 3)
    assert torch.equal(long[:, :8], short) and not long[:, 8:].any()
    assert torch.nonzero(long[6]).flatten().tolist() == [0, 1, 5]
    assert torch.nonzero(long[1]).flatten().tolist() == [0, 1]


def test_two_indexer_heads_stay_causal_in_the_model(tmp_path):
    """With 2 heads many scores tie at 0 (the reference's trap); ours must still give the same logits
    whether a position is computed in the full prefill, in a chunk, or in decode."""
    from v4_helpers import load_ours, run_chunks, write_tiny

    write_tiny(str(tmp_path), seed=5, index_n_heads=2, index_topk=2)
    model = load_ours(str(tmp_path))
    ids = torch.randint(2, 1024, (45,), generator=torch.Generator().manual_seed(8)).tolist()
    full = run_chunks(model, ids, [45])
    torch.testing.assert_close(run_chunks(model, ids, [20, 1]), full, atol=2e-5, rtol=0)
    torch.testing.assert_close(run_chunks(model, ids, [3, 7]), full, atol=2e-5, rtol=0)
