"""RoPE / YaRN against Hugging Face transformers' DeepSeek V2 and V3 modules."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf3  # noqa: E402

from deepinfer.backend.native.rope import mla_softmax_scale, rope_cos_sin_cache, rotary_embedding  # noqa: E402
from deepinfer.errors import ConfigError  # noqa: E402

R = 16  # qk_rope_head_dim
MAX_POS = 512

SCALINGS = [
    None,
    {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0},
    {"type": "yarn", "factor": 8, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.707, "mscale_all_dim": 1.0},  # attention_factor != 1
    {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 128},  # no mscale keys
]


def _v3_config(scaling: dict | None, rope_theta: float = 10000.0) -> DeepseekV3Config:
    kw = dict(hidden_size=32, num_attention_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=R, v_head_dim=8,
              kv_lora_rank=16, q_lora_rank=12, max_position_embeddings=MAX_POS, rope_theta=rope_theta)
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    cfg = DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _v2_config(scaling: dict | None) -> DeepseekV2Config:
    kw = dict(hidden_size=32, num_attention_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=R, v_head_dim=8,
              kv_lora_rank=16, q_lora_rank=None, max_position_embeddings=MAX_POS)
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    cfg = DeepseekV2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.mark.parametrize("scaling", SCALINGS)
def test_cos_sin_cache_matches_hf_v3(scaling):
    cfg = _v3_config(scaling, rope_theta=1000.0)
    rot = hf3.DeepseekV3RotaryEmbedding(cfg)
    pos = torch.arange(MAX_POS)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    cache = rope_cos_sin_cache(R, MAX_POS, 1000.0, scaling)
    assert cache.dtype == torch.float32 and cache.shape == (MAX_POS, R)
    torch.testing.assert_close(cache[:, : R // 2], cos[0, :, : R // 2], rtol=0, atol=0)
    torch.testing.assert_close(cache[:, R // 2 :], sin[0, :, : R // 2], rtol=0, atol=0)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_cos_sin_cache_matches_hf_v2_complex(scaling):
    cfg = _v2_config(scaling)
    freqs_cis = hf2.DeepseekV2RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(MAX_POS)[None])[0]
    cache = rope_cos_sin_cache(R, MAX_POS, 10000.0, scaling)
    torch.testing.assert_close(cache[:, : R // 2], freqs_cis.real, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[:, R // 2 :], freqs_cis.imag, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_softmax_scale_matches_hf_attention(scaling):
    for attn in (hf3.DeepseekV3Attention(_v3_config(scaling), 0), hf2.DeepseekV2Attention(_v2_config(scaling), 0)):
        assert mla_softmax_scale(8 + R, scaling) == pytest.approx(attn.scaling, rel=1e-12)


def test_yarn_mscale_changes_scale():
    s = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert mla_softmax_scale(192, s) > 192**-0.5 * 1.3  # (0.1 ln 40 + 1)^2 ~ 1.87


def test_unknown_rope_type_is_an_error():
    with pytest.raises(ConfigError, match="dynamic"):
        rope_cos_sin_cache(R, 8, 10000.0, {"type": "dynamic", "factor": 2.0})


def _qk(t=7, hq=3, hk=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, hq, R, generator=g), torch.randn(t, hk, R, generator=g)


@pytest.mark.parametrize("scaling", SCALINGS[:2])
def test_interleaved_equals_hf_v2_layout(scaling):
    """Our interleaved output is HF V2's complex-multiply output, element by element."""
    q, k = _qk()
    pos = torch.tensor([0, 3, 5, 100, 101, 7, 511])
    cache = rope_cos_sin_cache(R, MAX_POS, 10000.0, scaling)
    oq, ok = rotary_embedding(pos, q, k, cache, interleaved=True)
    freqs = hf2.DeepseekV2RotaryEmbedding(_v2_config(scaling))(q, pos[None])  # [1, T, R/2]
    hq, hk = hf2.apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs)  # [1, H, T, R]
    torch.testing.assert_close(oq, hq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ok, hk[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_interleaved_is_hf_v3_deinterleaved_and_preserves_qk():
    """HF V3 returns [even | odd]; ours keeps pairs in place: same numbers, same q.k."""
    q, k = _qk(seed=1)
    pos = torch.tensor([0, 1, 2, 9, 50, 200, 300])
    scaling = SCALINGS[2]
    cfg = _v3_config(scaling)
    cos, sin = hf3.DeepseekV3RotaryEmbedding(cfg)(q, pos[None])
    hq, hk = hf3.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    hq, hk = hq[0].transpose(0, 1), hk[0].transpose(0, 1)
    oq, ok = rotary_embedding(pos, q, k, rope_cos_sin_cache(R, MAX_POS, 10000.0, scaling), interleaved=True)
    perm = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])
    torch.testing.assert_close(oq[..., perm], hq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ok[..., perm], hk, rtol=1e-6, atol=1e-6)
    ours = torch.einsum("thr,shr->hts", oq, ok.expand_as(oq))
    theirs = torch.einsum("thr,shr->hts", hq, hk.expand_as(hq))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_neox_layout_equals_hf_rotate_half():
    q, k = _qk(seed=2)
    pos = torch.arange(7) * 11
    cfg = _v3_config(None)
    cos, sin = hf3.DeepseekV3RotaryEmbedding(cfg)(q, pos[None])
    hq, hk = hf3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    oq, ok = rotary_embedding(pos, q, k, rope_cos_sin_cache(R, MAX_POS, 10000.0, None), interleaved=False)
    torch.testing.assert_close(oq, hq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ok, hk[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_bf16_is_computed_in_fp32_and_cast_back():
    q, k = _qk(seed=3)
    pos = torch.arange(7)
    cache = rope_cos_sin_cache(R, MAX_POS, 10000.0, None)
    oq, ok = rotary_embedding(pos, q.bfloat16(), k.bfloat16(), cache, interleaved=True)
    rq, rk = rotary_embedding(pos, q.bfloat16().float(), k.bfloat16().float(), cache, interleaved=True)
    assert oq.dtype == torch.bfloat16
    assert torch.equal(oq, rq.bfloat16()) and torch.equal(ok, rk.bfloat16())
