"""fp8 KV cache (EngineConfig.kv_cache_dtype="fp8"): the quantizer, the native and cpu MLA ops on an fp8 cache,
the settings and start-up checks, the salt, the planner's bytes, and the accuracy against a full-precision cache
on the embedded trained model. The Triton kernels are in test_kv_cache_fp8_triton.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from quant_testutil import PagedKV

from deepinfer.backend import BackendCaps, FeatureRequest, ForwardBatch, MLASpec, NativeMLAAttention
from deepinfer.backend.kv_caches import KVLayout
from deepinfer.backend.kv_spec import FP8_E4M3_MAX, KVCacheSpec, dequantize_kv, quantize_kv
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.backends.cpu.ops_mla import CPUMLAAttention
from deepinfer.config import EngineConfig
from deepinfer.engine.startup import cache_salt, check_backend
from deepinfer.errors import BackendError, ConfigError

FP8 = torch.float8_e4m3fn
SPEC = MLASpec(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
               softmax_scale=0.2)
ENTRY = SPEC.cache_entry_dim
PAGE = 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ------------------------------------------------------------ the quantizer


def test_quantize_is_torch_cast_clamped():
    """scale 1: exactly torch's own float8 cast (bitwise, subnormals and signed zeros included); beyond e4m3's
    ±448 it saturates instead of producing NaN; with a scale it is the cast of x / scale; reads are stored * scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 40, torch.randn(4000, generator=g) * 0.005,
                   torch.tensor([0.0, -0.0, 448.0, -447.9, 2.0**-9, -(2.0**-10)])])
    assert torch.equal(_bits(quantize_kv(x, FP8)), _bits(x.to(FP8)))
    big = torch.tensor([449.0, 1e4, -1e6, 480.0])
    assert quantize_kv(big, FP8).float().tolist() == [FP8_E4M3_MAX, FP8_E4M3_MAX, -FP8_E4M3_MAX, FP8_E4M3_MAX]
    assert torch.equal(_bits(quantize_kv(x, FP8, 0.25)), _bits((x / 0.25).clamp(-448, 448).to(FP8)))
    stored = quantize_kv(x, FP8, 0.25)
    assert torch.equal(dequantize_kv(stored, 0.25), stored.float() * 0.25)
    # bf16 input: the cast of its fp32 value (what the ops hand over: rows in the compute dtype)
    xb = x.bfloat16()
    assert torch.equal(_bits(quantize_kv(xb, FP8)), _bits(xb.float().to(FP8)))
    # a compute-dtype cache is a plain cast, unscaled
    assert torch.equal(quantize_kv(x, torch.float32, 0.25), x)


# ------------------------------------------------------------ the ops on an fp8 cache


def _batch(ctx: list[int], qlen: list[int], num_blocks: int, g: torch.Generator) -> ForwardBatch:
    seq = [c + q for c, q in zip(ctx, qlen)]
    width = max(-(-s // PAGE) for s in seq)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq), width), -1, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq):
        n = -(-s // PAGE)
        table[i, :n] = perm[used : used + n].int()
        used += n
    pos, slots = [], []
    for i, (c, q) in enumerate(zip(ctx, qlen)):
        for p in range(c, c + q):
            pos.append(p)
            slots.append(int(table[i, p // PAGE]) * PAGE + p % PAGE)
    qsl = [0]
    for q in qlen:
        qsl.append(qsl[-1] + q)
    return ForwardBatch(
        input_ids=torch.zeros(sum(qlen), dtype=torch.int64), positions=torch.tensor(pos),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), block_tables={"mla": table},
        slot_mapping={"mla": torch.tensor(slots)}, logits_indices=torch.tensor([x - 1 for x in qsl[1:]]),
        query_lens_cpu=list(qlen), seq_lens_cpu=seq, context_lens_cpu=list(ctx), block_size=PAGE,
    )


def _case(ctx, qlen, num_blocks=24, seed=1):
    """A batch over a cache whose context entries are already written (fp32 values), and the step's inputs."""
    g = torch.Generator().manual_seed(seed)
    batch = _batch(ctx, qlen, num_blocks, g)
    t = sum(qlen)
    context = torch.randn(num_blocks, PAGE, ENTRY, generator=g) * 2
    q = torch.randn(t, SPEC.num_heads, SPEC.qk_nope_head_dim + SPEC.qk_rope_head_dim, generator=g)
    kv_c = torch.randn(t, SPEC.kv_lora_rank, generator=g)
    k_pe = torch.randn(t, SPEC.qk_rope_head_dim, generator=g) * 3
    kv_c[0, :3] = torch.tensor([600.0, -900.0, 1e-4])  # beyond e4m3's range and below its subnormals
    w = torch.randn(SPEC.num_heads * (SPEC.qk_nope_head_dim + SPEC.v_head_dim), SPEC.kv_lora_rank, generator=g) / 6
    return batch, context, q, kv_c, k_pe, w


def _op(cls, w, scale):
    op = cls(SPEC) if cls is NativeMLAAttention else cls(SPEC, None)
    op.load_kv_b_proj(w)
    op.load_kv_scale(scale)
    return op


CASES = [([3, 6, 0, 9], [5, 1, 4, 1]),  # prefill on a prefix, decode, fresh prefill, decode
         ([9, 0, 14], [1, 1, 1])]  # decode only (the cpu op's batched path)


@pytest.mark.parametrize("scale", [1.0, 0.375])
@pytest.mark.parametrize("ctx,qlen", CASES)
def test_native_op_is_dequantize_then_compute(ctx, qlen, scale):
    """The native op on an fp8 cache writes exactly quantize_kv(kv_c || k_pe) into the slots, and its output
    equals the same op on an fp32 cache that holds the dequantized values (bitwise: the same fp32 math)."""
    batch, context, q, kv_c, k_pe, w = _case(ctx, qlen)
    op = _op(NativeMLAAttention, w, scale)
    cache = quantize_kv(context, FP8, scale)
    out = op.forward(q, kv_c, k_pe, cache, batch, "mla")
    slots = batch.slot_mapping["mla"]
    written = cache.view(-1, ENTRY)[slots]
    assert torch.equal(_bits(written), _bits(quantize_kv(torch.cat([kv_c, k_pe], -1), FP8, scale)))
    assert written[0, 0].float() * scale == FP8_E4M3_MAX * scale  # clamped on write, not NaN

    ref = _op(NativeMLAAttention, w, 1.0)
    deq = dequantize_kv(quantize_kv(context, FP8, scale), scale)
    new = dequantize_kv(written, scale)
    ref_out = ref.forward(q, new[:, : SPEC.kv_lora_rank], new[:, SPEC.kv_lora_rank :], deq, batch, "mla")
    assert torch.equal(out, ref_out)


def test_native_op_split_layout_fp8():
    """A two-part layout (latent | rope, as Ascend-style backends store it) in fp8: same bytes, same output."""
    batch, context, q, kv_c, k_pe, w = _case(*CASES[0])
    spec = KVCacheSpec("mla", (0,), (ENTRY,), FP8, components=(("latent", SPEC.kv_lora_rank),
                                                               ("rope", SPEC.qk_rope_head_dim)))
    layout = KVLayout.split_components(spec)
    one = quantize_kv(context, FP8, 0.5)
    two = layout.split(one.clone())
    op = _op(NativeMLAAttention, w, 0.5)
    a = op.forward(q, kv_c, k_pe, one, batch, "mla")
    b = op.forward(q, kv_c, k_pe, two, batch, "mla")
    assert torch.equal(a, b)
    assert torch.equal(_bits(layout.join(two)), _bits(one))


@pytest.mark.parametrize("scale", [1.0, 0.375])
@pytest.mark.parametrize("ctx,qlen", CASES)
def test_cpu_op_matches_native_on_fp8_cache(ctx, qlen, scale):
    """The cpu backend's batched op stores the same fp8 bytes as the oracle and matches its output to fp32
    rounding (its decode sums in another order)."""
    batch, context, q, kv_c, k_pe, w = _case(ctx, qlen)
    caches = [quantize_kv(context, FP8, scale) for _ in range(2)]
    out = _op(CPUMLAAttention, w, scale).forward(q, kv_c, k_pe, caches[0], batch, "mla")
    ref = _op(NativeMLAAttention, w, scale).forward(q, kv_c, k_pe, caches[1], batch, "mla")
    assert torch.equal(_bits(caches[0]), _bits(caches[1]))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


def test_kv_scale_must_be_positive():
    op = NativeMLAAttention(SPEC)
    for bad in (0.0, -1.0, float("inf"), float("nan"), 1e39, 1e-50):  # (the last two: inf and 0 in fp32)
        with pytest.raises(BackendError, match="fp8 KV scale"):
            op.load_kv_scale(bad)


# ------------------------------------------------------------ settings, caps, salt, planner


def test_config_field_and_validation():
    assert EngineConfig().kv_cache_storage() == "auto"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_storage() == "fp8_e4m3"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_storage() == "fp8_e4m3"
    for bad in ("fp8_e5m2", "bf16", None, 8):
        with pytest.raises(ConfigError, match="EngineConfig.kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)


def test_cli_flag_maps_to_field():
    import argparse

    from deepinfer.entrypoints.cli_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_storage() == "fp8_e4m3"
    assert engine_config_from_args(p.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])


def test_backends_declare_or_refuse_fp8_kv():
    """cpu declares it; a backend whose caps do not list it (the cautious default, Ascend's today) refuses with
    the reason; batch-invariant ops do not read fp8 and are refused too; V4 is refused by model type."""
    want = FeatureRequest(model_type="deepseek_v3", kv_cache_dtype="fp8_e4m3")
    assert "fp8_e4m3" in CPUBackend().caps.kv_cache_dtypes
    assert CPUBackend().caps.unsupported(want) == []
    reasons = BackendCaps().unsupported(want)
    assert len(reasons) == 1 and "KV cache dtype 'fp8_e4m3'" in reasons[0] and "--kv-cache-dtype" in reasons[0]
    inv = CPUBackend().caps.unsupported(dataclasses.replace(want, batch_invariant=True))
    assert any("batch-invariant" in r and "fp8" in r for r in inv)
    be = CPUBackend()
    check_backend(be, EngineConfig(kv_cache_dtype="fp8"), torch.float32, None, "deepseek_v3")  # no error
    with pytest.raises(BackendError, match="kv_cache_dtype='fp8'.*deepseek_v4"):
        check_backend(be, EngineConfig(kv_cache_dtype="fp8"), torch.float32, None, "deepseek_v4")


def test_ascend_caps_refuse_fp8_kv():
    """Ascend's caps (built on the CPU as its tests do) do not list fp8 KV: an fp8 request gets the reason."""
    from deepinfer.backends.ascend.caps import SUPPORTED_CHIPS, ascend_caps

    caps = ascend_caps(SUPPORTED_CHIPS[0], on_cpu=True)
    reasons = caps.unsupported(FeatureRequest(model_type="deepseek_v3", kv_cache_dtype="fp8_e4m3"))
    assert any("KV cache dtype 'fp8_e4m3'" in r for r in reasons)


@pytest.fixture(scope="module")
def trained():
    """The embedded trained model (stdlib-coder, V3-shaped, 4 layers) in fp32 on the cpu backend."""
    from deepinfer.data import embedded_model_path
    from deepinfer.models.registry import load_model
    from deepinfer.text.tokenizer import Tokenizer

    path = embedded_model_path()
    return load_model(path, CPUBackend(), torch.float32, progress=False), Tokenizer.from_pretrained(path)


def test_specs_planner_and_salt(trained):
    """kv_cache_specs in fp8: every layer (MTP ones share the group) at 1 byte per value, a quarter of fp32 and
    half of bf16 in the planner's count; the prefix-cache salt differs between fp8 and compute-dtype caches."""
    model, _ = trained
    full, fp8 = model.kv_cache_specs()[0], model.kv_cache_specs(kv_cache_dtype=FP8)[0]
    assert fp8.dtype == FP8 and fp8.layer_ids == full.layer_ids and fp8.components == full.components
    assert fp8.bytes_per_entry() * 4 == full.bytes_per_entry()
    assert fp8.bytes_per_entry() * 2 == dataclasses.replace(full, dtype=torch.bfloat16).bytes_per_entry()
    from deepinfer.kv.planner import plan_kv_cache

    budget = 1 << 20
    plans = [plan_kv_cache([s], 16, 64, 4096, 64, budget_bytes=budget) for s in (full, fp8)]
    assert plans[1].num_blocks["mla"] >= 4 * plans[0].num_blocks["mla"] - 4
    with pytest.raises(Exception, match="KV cache dtype"):
        model.kv_cache_specs(kv_cache_dtype=torch.float16)
    be = model.backend
    assert cache_salt(model, 16, be) == cache_salt(model, 16, be, "auto")
    assert cache_salt(model, 16, be, "fp8_e4m3") != cache_salt(model, 16, be)


# ------------------------------------------------------------ accuracy


# Measured on this text (2026-12, fp32 compute, 320 tokens: a 160-token prefill, an 80-token chunk on that
# prefix, 80 teacher-forced decode steps): agreement 0.95 overall, 1.0 where the reference's top-2 logit
# margin exceeds 0.5; a bf16 cache gives 0.99. e4m3 keeps 3 mantissa bits (half a step = 6.25% of a value),
# so flips are expected on near-ties only; the thresholds leave room for the test text's few dozen near-ties.
MIN_AGREEMENT = 0.92
MIN_AGREEMENT_CLEAR = 0.99  # rows whose reference top-2 margin is > CLEAR_MARGIN
CLEAR_MARGIN = 0.5


def _teacher_forced(model, ids: list[int], kv_dtype) -> torch.Tensor:
    kv = PagedKV(model, num_blocks=32, specs=model.kv_cache_specs(kv_cache_dtype=kv_dtype))
    out = [kv.step([(0, ids[:160])]), kv.step([(0, ids[160:240])])]
    out += [kv.step([(0, [t])]) for t in ids[240:]]
    if kv_dtype is not None:
        assert kv.caches.get("mla", 0).dtype == kv_dtype
    return torch.cat(out).float()


def test_fp8_cache_top1_agreement(trained):
    """Teacher-forced top-1 of the fp8-cache model vs the fp32-cache model on stdlib code (the model's domain):
    prefill, a chunk on a cached fp8 prefix and decode all read the fp8 cache."""
    import argparse

    model, tok = trained
    ids = tok.encode(Path(argparse.__file__).read_text()[20000:30000])[:320]
    assert len(ids) == 320
    ref = _teacher_forced(model, ids, None)
    got = _teacher_forced(model, ids, FP8)
    agree = (ref.argmax(-1) == got.argmax(-1)).float()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
    nxt = torch.tensor(ids[1:])
    acc_ref = float((ref[:-1].argmax(-1) == nxt).float().mean())
    acc_fp8 = float((got[:-1].argmax(-1) == nxt).float().mean())
    lp_gap = (ref.log_softmax(-1) - got.log_softmax(-1)).gather(1, ref.argmax(-1, keepdim=True)).abs().mean()
    print(f"fp8 KV: top-1 agreement {float(agree.mean()):.4f} (clear rows {float(agree[clear].mean()):.4f} of "
          f"{int(clear.sum())}), next-token accuracy {acc_fp8:.3f} vs {acc_ref:.3f}, mean |logprob gap| "
          f"{float(lp_gap):.4f}")
    assert float(agree.mean()) >= MIN_AGREEMENT
    assert float(agree[clear].mean()) >= MIN_AGREEMENT_CLEAR
    assert abs(acc_fp8 - acc_ref) <= 0.03
    assert not torch.equal(ref, got)  # the cache really was fp8: the logits moved


def test_engine_allocates_fp8_cache():
    """EngineConfig(kv_cache_dtype="fp8") gives float8 caches, a salt of its own, and greedy tokens."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(kv_cache_dtype="fp8", device="cpu", max_model_len=128, max_num_seqs=2, load_progress=False)
    assert llm.runner.caches.get("mla", 0).dtype == FP8
    assert llm.kv.cache_salt == cache_salt(llm.model, llm.kv.block_size, llm.backend, "fp8_e4m3")
    out = llm.generate(["def main():"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


# ------------------------------------------------------------ KV scales from a checkpoint (models/layers/kv_scale.py)


def _checkpoint_with(tmp_path: Path, extra: dict[str, torch.Tensor]) -> Path:
    """The embedded model's checkpoint (linked, not copied) plus `extra` tensors in a second shard, both listed by
    a model.safetensors.index.json, as a sharded release lays them out."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from deepinfer.data import embedded_model_path

    src, dst = Path(embedded_model_path()), tmp_path / "ckpt"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    (dst / "model-1.safetensors").symlink_to(src / "model.safetensors")
    save_file(extra, str(dst / "model-2.safetensors"))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    weight_map = {**{n: "model-1.safetensors" for n in names}, **{n: "model-2.safetensors" for n in extra}}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _load(path: Path, load_mtp: bool = False):
    from deepinfer.models.registry import load_model

    return load_model(str(path), CPUBackend(), torch.float32, progress=False, load_mtp=load_mtp)


def test_checkpoint_kv_scales_reach_every_layer(tmp_path):
    """A checkpoint's per-layer `self_attn.k_scale` (and its aliases `kv_scale`, `attn.k_scale`, with a `v_scale`
    equal to it) sets each MLA op's fp8 scale, the MTP layer's included; a layer without one stays at 1.0; the
    prefix-cache salt of an fp8 cache carries them. An fp8-cache engine on it generates."""
    from deepinfer import LLM, SamplingParams

    one = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731 (scalars, as llm-compressor stores them)
    extra = {"model.layers.0.self_attn.k_scale": one(0.5), "model.layers.0.self_attn.v_scale": one(0.5),
             "model.layers.1.self_attn.kv_scale": one(0.25), "model.layers.2.self_attn.attn.k_scale": one(2.0),
             "model.layers.4.self_attn.k_scale": one(0.375)}  # layer 4: the MTP layer (4 decoder layers)
    path = _checkpoint_with(tmp_path, extra)
    model = _load(path, load_mtp=True)
    scales = [layer.self_attn.attn.kv_scale for layer in model.layers] + [m.block.self_attn.attn.kv_scale
                                                                          for m in model.mtp]
    assert scales == [0.5, 0.25, 2.0, 1.0, 0.375]
    unit = _load(_checkpoint_with(tmp_path / "unit", {"model.layers.0.self_attn.k_scale": one(1.0)}), load_mtp=True)
    assert [layer.self_attn.attn.kv_scale for layer in unit.layers] == [1.0] * 4
    assert cache_salt(model, 16, model.backend, "fp8_e4m3") != cache_salt(unit, 16, unit.backend, "fp8_e4m3")
    assert cache_salt(model, 16, model.backend) == cache_salt(unit, 16, unit.backend)  # (a bf16 cache ignores them)
    llm = LLM(model=str(path), kv_cache_dtype="fp8", device="cpu", max_model_len=128, max_num_seqs=2,
              load_progress=False)
    assert llm.model.layers[1].self_attn.attn.kv_scale == 0.25
    out = llm.generate(["def main():"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("extra,match", [
    ({"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.kv_scale": 0.25},
     r"KV-cache scales disagree .*layers\.0\.self_attn\.k_scale = 0\.5"),
    ({"model.layers.1.self_attn.k_scale": 0.5, "model.layers.1.self_attn.v_scale": 0.25},
     r"layers\.1\.self_attn\.v_scale = 0\.25 differs from the key scale \(0\.5\)"),
    ({"model.layers.1.self_attn.v_scale": 0.25}, r"v_scale = 0\.25 differs from the key scale \(none given"),
    ({"model.layers.2.self_attn.k_scale": -1.0}, r"layers\.2\.self_attn\.k_scale: .* positive and finite"),
    ({"model.layers.2.self_attn.k_scale": float("nan")}, r"k_scale: .* positive and finite"),
    ({"model.layers.3.self_attn.k_scale": [0.5, 0.5]}, r"layers\.3\.self_attn\.k_scale: a KV-cache scale is one"),
    ({"model.layers.4.self_attn.k_scale": 0.5, "model.layers.4.self_attn.v_scale": 2.0}, r"layers\.4\.self_attn\.v_scale"),
])
def test_checkpoint_kv_scales_refused(tmp_path, extra, match):
    """Scales MLA cannot honour (key names disagreeing, a value scale other than the key scale: one latent, one
    scale), and scales that are not one positive finite number, are load errors naming the tensor."""
    from deepinfer.errors import ModelLoadError

    path = _checkpoint_with(tmp_path, {k: torch.tensor(v, dtype=torch.float32) for k, v in extra.items()})
    with pytest.raises(ModelLoadError, match=match):
        _load(path, load_mtp=True)  # (layer 4: the MTP layer's attention)
