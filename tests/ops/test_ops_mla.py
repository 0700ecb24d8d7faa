"""MLA attention: HF's attention layers fed the same weights; decode == prefill; paging and chunking invariance."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf3  # noqa: E402

from deepinfer.backend import MLASpec  # noqa: E402
from deepinfer.backend.forward_batch import ForwardBatch  # noqa: E402
from deepinfer.backend.native import NativeOps, mla_softmax_scale, rope_cos_sin_cache  # noqa: E402
from deepinfer.errors import BackendError  # noqa: E402

OPS = NativeOps()
H, NOPE, ROPE, V, L = 3, 8, 4, 6, 16
BS = 4
YARN = {"type": "yarn", "factor": 8, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 1.0}


def make_batch(query_lens, context_lens, block_tables, name="mla", block_size=BS) -> ForwardBatch:
    """Slots and tensors for requests that own the given block-table rows."""
    slots, positions = [], []
    for q, c, row in zip(query_lens, context_lens, block_tables):
        for p in range(c, c + q):
            slots.append(row[p // block_size] * block_size + p % block_size)
            positions.append(p)
    width = max(len(r) for r in block_tables)
    bt = torch.tensor([r + [-1] * (width - len(r)) for r in block_tables], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = [q + c for q, c in zip(query_lens, context_lens)]
    return ForwardBatch(
        input_ids=torch.zeros(sum(query_lens), dtype=torch.long), positions=torch.tensor(positions),
        query_start_loc=qsl, seq_lens=torch.tensor(seq, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables={name: bt},
        slot_mapping={name: torch.tensor(slots, dtype=torch.long)}, logits_indices=qsl[1:].long() - 1,
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq, context_lens_cpu=list(context_lens), block_size=block_size,
    )


# ------------------------------------------------------------------ against HF attention layers


def _hf_layer(version: int):
    common = dict(hidden_size=24, num_attention_heads=H, num_key_value_heads=H, qk_nope_head_dim=NOPE,
                  qk_rope_head_dim=ROPE, v_head_dim=V, kv_lora_rank=L, max_position_embeddings=128,
                  rope_scaling=dict(YARN))
    if version == 3:
        cfg = DeepseekV3Config(q_lora_rank=10, **common)
        cfg._attn_implementation = "eager"
        attn, rot = hf3.DeepseekV3Attention(cfg, 0), hf3.DeepseekV3RotaryEmbedding(cfg)
    else:
        cfg = DeepseekV2Config(q_lora_rank=None, **common)
        cfg._attn_implementation = "eager"
        attn, rot = hf2.DeepseekV2Attention(cfg, 0), hf2.DeepseekV2RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return attn, rot


def _ours(attn, hidden: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
    """The model-side projections done with the HF module's weights, then our rope + MLA op."""
    t = hidden.shape[0]
    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden)
    else:
        qa = attn.q_a_proj(hidden)
        q = attn.q_b_proj(OPS.rms_norm(qa, attn.q_a_layernorm.weight, attn.q_a_layernorm.variance_epsilon))
    q = q.view(t, H, NOPE + ROPE)
    kv_c, k_pe = attn.kv_a_proj_with_mqa(hidden).split([L, ROPE], dim=-1)
    kv_c = OPS.rms_norm(kv_c, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.variance_epsilon)
    cs = rope_cos_sin_cache(ROPE, 128, 10000.0, YARN)
    q_pe, k_pe = OPS.rotary_embedding(batch.positions, q[..., NOPE:], k_pe[:, None], cs, interleaved=True)
    q = torch.cat([q[..., :NOPE], q_pe], dim=-1)
    spec = MLASpec(H, NOPE, ROPE, V, L, mla_softmax_scale(NOPE + ROPE, YARN))
    op = OPS.make_mla_attention(spec)
    op.load_kv_b_proj(attn.kv_b_proj.weight.detach())
    return attn.o_proj(op.forward(q, kv_c, k_pe[:, 0], cache, batch, "mla"))


@pytest.mark.parametrize("version", [2, 3])
@torch.no_grad()
def test_prefill_matches_hf_attention(version):
    attn, rot = _hf_layer(version)
    s = 10
    hidden = torch.randn(1, s, 24, generator=torch.Generator().manual_seed(7))
    pos = torch.arange(s)[None]
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    ref = attn(hidden, position_embeddings=rot(hidden, pos), attention_mask=mask)[0][0]
    cache = torch.zeros(6, BS, L + ROPE)
    out = _ours(attn, hidden[0], make_batch([s], [0], [[4, 0, 2]]), cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # chunked: prefill 6, then a chunk of 3 on the cached prefix, then a 1-token decode
    cache = torch.zeros(6, BS, L + ROPE)
    outs = [
        _ours(attn, hidden[0, a:b], make_batch([b - a], [a], [[4, 0, 2]]), cache)
        for a, b in ((0, 6), (6, 9), (9, 10))
    ]
    torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ internal consistency


def _op_and_inputs(t: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    spec = MLASpec(H, NOPE, ROPE, V, L, softmax_scale=0.25)
    op = OPS.make_mla_attention(spec)
    op.load_kv_b_proj((torch.randn(H * (NOPE + V), L, generator=g) * 0.3).to(dtype))
    q = torch.randn(t, H, NOPE + ROPE, generator=g).to(dtype)
    kv_c = torch.randn(t, L, generator=g).to(dtype)
    k_pe = torch.randn(t, ROPE, generator=g).to(dtype)
    return op, q, kv_c, k_pe


def test_absorbed_decode_equals_naive_prefill():
    s = 13
    op, q, kv_c, k_pe = _op_and_inputs(s)
    cache = torch.zeros(8, BS, L + ROPE)
    full = op.forward(q, kv_c, k_pe, cache, make_batch([s], [0], [[0, 1, 2, 3]]), "mla")
    # every row of the prefill, recomputed as a 1-token absorbed decode over the cached context
    for p in range(s):
        row = op.forward(q[p : p + 1], kv_c[p : p + 1], k_pe[p : p + 1], cache,
                         make_batch([1], [p], [[0, 1, 2, 3]]), "mla")
        torch.testing.assert_close(row, full[p : p + 1], rtol=1e-5, atol=1e-5)
    # and the two paths directly on the same latent context
    latent = torch.cat([kv_c, k_pe], -1)
    naive = op.prefill(q[-1:].float(), latent, context_len=s - 1)
    absorbed = op.decode(q[-1:].float(), latent)
    torch.testing.assert_close(absorbed, naive, rtol=1e-5, atol=1e-5)


def test_shuffled_block_tables_equal_contiguous():
    lens = [9, 5, 1]
    op, q, kv_c, k_pe = _op_and_inputs(sum(lens), seed=3)
    contiguous = [[0, 1, 2], [3, 4], [5]]
    shuffled = [[7, 2, 9], [0, 5], [3]]
    out_a = op.forward(q, kv_c, k_pe, torch.zeros(10, BS, L + ROPE), make_batch(lens, [0, 0, 0], contiguous), "mla")
    out_b = op.forward(q, kv_c, k_pe, torch.zeros(10, BS, L + ROPE), make_batch(lens, [0, 0, 0], shuffled), "mla")
    assert torch.equal(out_a, out_b)


def test_mixed_batch_of_chunks_equals_one_shot_per_request():
    """Request A: chunk 4 on a cached prefix of 5; B: decode at 7; C: fresh prefill of 6 - one batch."""
    tables = [[2, 6, 0], [5, 1], [3, 4]]
    op, q, kv_c, k_pe = _op_and_inputs(9 + 8 + 6, seed=4)
    full_a = slice(0, 9)
    full_b = slice(9, 17)
    full_c = slice(17, 23)
    ref = []
    for sl, tab in ((full_a, tables[0]), (full_b, tables[1]), (full_c, tables[2])):
        n = sl.stop - sl.start
        ref.append(op.forward(q[sl], kv_c[sl], k_pe[sl], torch.zeros(8, BS, L + ROPE), make_batch([n], [0], [tab]),
                              "mla"))
    cache = torch.zeros(8, BS, L + ROPE)
    # step 1: prefixes (A: 5 tokens, B: 7 tokens)
    idx1 = torch.cat([torch.arange(0, 5), torch.arange(9, 16)])
    op.forward(q[idx1], kv_c[idx1], k_pe[idx1], cache, make_batch([5, 7], [0, 0], tables[:2]), "mla")
    # step 2: A chunk of 4 on its prefix, B decode, C prefill
    idx2 = torch.cat([torch.arange(5, 9), torch.arange(16, 17), torch.arange(17, 23)])
    out = op.forward(q[idx2], kv_c[idx2], k_pe[idx2], cache, make_batch([4, 1, 6], [5, 7, 0], tables), "mla")
    expect = torch.cat([ref[0][5:9], ref[1][7:8], ref[2]])
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_bf16_output_close_to_fp32():
    op32, q, kv_c, k_pe = _op_and_inputs(6, seed=5)
    op16, *_ = _op_and_inputs(6, seed=5, dtype=torch.bfloat16)
    a = op32.forward(q, kv_c, k_pe, torch.zeros(2, BS, L + ROPE), make_batch([6], [0], [[0, 1]]), "mla")
    b = op16.forward(q.bfloat16(), kv_c.bfloat16(), k_pe.bfloat16(), torch.zeros(2, BS, L + ROPE, dtype=torch.bfloat16),
                     make_batch([6], [0], [[0, 1]]), "mla")
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), a, rtol=5e-2, atol=5e-2)


def test_bad_block_table_is_an_error():
    op, q, kv_c, k_pe = _op_and_inputs(6)
    batch = make_batch([6], [0], [[0, 1]])
    batch.block_tables["mla"][0, 1] = -1
    with pytest.raises(BackendError, match="block table"):
        op.forward(q, kv_c, k_pe, torch.zeros(2, BS, L + ROPE), batch, "mla")


def test_prefill_query_blocking(monkeypatch):
    """Long prefills run in query blocks; a small block size must give the same result."""
    import deepinfer.backend.native.mla_attention as mla

    op, q, kv_c, k_pe = _op_and_inputs(21, seed=6)
    batch = make_batch([21], [0], [[0, 1, 2, 3, 4, 5]])
    whole = op.forward(q, kv_c, k_pe, torch.zeros(6, BS, L + ROPE), batch, "mla")
    monkeypatch.setattr(mla, "PREFILL_Q_BLOCK", 4)
    blocked = op.forward(q, kv_c, k_pe, torch.zeros(6, BS, L + ROPE), batch, "mla")
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-5)
