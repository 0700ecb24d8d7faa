"""The MLA prolog (npu_mla_prolog_v3) and the paged KV scatter (npu_scatter_pa_kv_cache): the fake's emulations
against torch-native code, then the ascend MLA op from the hidden states against the native composition (the
conformance suite's `mla_prolog_cases`), and the model's MLA layer handing the op its hidden states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.backend import NativeOps
from deepinfer.backend.native.rope import rope_cos_sin_cache
from deepinfer.backend.specs import MLASpec
from deepinfer.conformance.layer_cases import _mla_batch, mla_prolog_cases
from deepinfer.conformance.runner import _Reference, to_device

BF = torch.bfloat16
SPEC = MLASpec(num_heads=2, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
               softmax_scale=192**-0.5)
HE, HCQ = 7168, 1536  # DeepSeek-V3 / R1: the only widths inside the prolog's 26.0.0 limits


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (2i, 2i+1) rotated by angle i, then written [all first | all second] (the stored order)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@pytest.fixture(scope="module")
def prolog_inputs():
    g, t, n = _g(0), 3, 2
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(BF)
    ang = torch.rand(t, 32, generator=g) * 6
    return {"x": r(t, HE), "w_dq": r(HE, HCQ, s=HE**-0.5), "w_uq_qr": r(HCQ, n * 192, s=HCQ**-0.5),
            "w_uk": r(n, 128, 512, s=128**-0.5), "w_dkv_kr": r(HE, 576, s=HE**-0.5), "g_cq": r(HCQ, s=0.3) + 1,
            "g_ckv": r(512, s=0.3) + 1, "ang": ang, "cos": ang.cos().repeat(1, 2).to(BF),
            "sin": ang.sin().repeat(1, 2).to(BF)}


def test_fake_mla_prolog_v3_is_the_documented_prolog(fake_npu, prolog_inputs):
    i, t, nb, bs = prolog_inputs, 3, 4, 16
    kv, kr = torch.zeros(nb, bs, 1, 512, dtype=BF), torch.zeros(nb, bs, 1, 64, dtype=BF)
    slots = torch.tensor([5, 40, 17])
    args = (i["x"], i["w_dq"], i["w_uq_qr"], i["w_uk"], i["w_dkv_kr"], i["g_cq"], i["g_ckv"], i["sin"], i["cos"])
    q_n, q_r, *_ = fake_npu.npu_mla_prolog_v3(*args, kv, kr, cache_index=slots, rmsnorm_epsilon_cq=1e-6,
                                              rmsnorm_epsilon_ckv=1e-6, cache_mode="PA_BSND")
    f = lambda a: a.float()
    c_q = F.rms_norm(f(i["x"]) @ f(i["w_dq"]), (HCQ,), f(i["g_cq"]), eps=1e-6)
    q_c = (c_q @ f(i["w_uq_qr"])).view(t, 2, 192)
    c, s = i["ang"].cos()[:, None], i["ang"].sin()[:, None]
    assert torch.allclose(f(q_n), torch.einsum("tnd,ndl->tnl", q_c[..., :128], f(i["w_uk"])), atol=5e-2, rtol=2e-2)
    assert torch.allclose(f(q_r), _interleaved_rope(q_c[..., 128:], c, s), atol=3e-2, rtol=2e-2)
    kv_a = f(i["x"]) @ f(i["w_dkv_kr"])
    assert torch.allclose(f(kv.view(-1, 512)[slots]), F.rms_norm(kv_a[:, :512], (512,), f(i["g_ckv"]), eps=1e-6),
                          atol=3e-2, rtol=2e-2)
    assert torch.allclose(f(kr.view(-1, 64)[slots]), _interleaved_rope(kv_a[:, 512:], c[:, 0], s[:, 0]), atol=3e-2)
    assert int((kv.view(-1, 512).abs().sum(-1) > 0).sum()) == t  # nothing but the three slots written
    # TND: the same rows into per-token buffers, no index
    kv_t, kr_t = torch.empty(t, 1, 512, dtype=BF), torch.empty(t, 1, 64, dtype=BF)
    q_n2, q_r2, *_ = fake_npu.npu_mla_prolog_v3(*args, kv_t, kr_t, rmsnorm_epsilon_cq=1e-6, rmsnorm_epsilon_ckv=1e-6,
                                                cache_mode="TND")
    assert torch.equal(q_n2, q_n) and torch.equal(q_r2, q_r)
    assert torch.equal(kv_t[:, 0], kv.view(-1, 512)[slots]) and torch.equal(kr_t[:, 0], kr.view(-1, 64)[slots])
    # documented limits
    with pytest.raises(ValueError, match="repeated"):
        fake_npu.npu_mla_prolog_v3(*args, kv, kr, cache_index=torch.tensor([1, 1, 2]), cache_mode="PA_BSND")
    with pytest.raises(ValueError, match="He 1000"):
        fake_npu.npu_mla_prolog_v3(i["x"][:, :1000].contiguous(), i["w_dq"][:1000].contiguous(), *args[2:4],
                                   i["w_dkv_kr"][:1000].contiguous(), *args[5:], kv, kr, cache_index=slots)
    with pytest.raises(TypeError):
        fake_npu.npu_mla_prolog_v3(i["x"].half(), *args[1:], kv, kr, cache_index=slots)
    with pytest.raises(NotImplementedError):
        fake_npu.npu_mla_prolog_v3(*args, kv, kr, cache_index=slots, weight_quant_mode=4)


def test_fake_scatter_pa_kv_cache_writes_the_nd_caches(fake_npu):
    g = _g(1)
    key, value = torch.randn(4, 1, 512, generator=g).to(BF), torch.randn(4, 1, 64, generator=g).to(BF)
    kc, vc = torch.zeros(3, 16, 1, 512, dtype=BF), torch.zeros(3, 16, 1, 64, dtype=BF)
    slots = torch.tensor([0, 47, 16, 5])
    fake_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="Norm")
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    for row, slot in enumerate(slots.tolist()):
        ref_k[slot // 16, slot % 16], ref_v[slot // 16, slot % 16] = key[row], value[row]
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    with pytest.raises(ValueError, match="repeated"):
        fake_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, torch.tensor([1, 1, 2, 3]), cache_mode="Norm")
    with pytest.raises(ValueError, match="outside"):
        fake_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, torch.tensor([-1, 1, 2, 3]), cache_mode="Norm")
    with pytest.raises(NotImplementedError):
        fake_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots)  # the default PA_NZ layout


def test_mla_from_hidden_states_matches_the_native_composition(ascend, fake_npu):
    batches = {"decode": ([1, 1, 1], [9, 20, 0], True), "mixed": ([5, 1], [0, 12], True),
               "decode halves": ([1, 1], [3, 7], False)}
    op = ascend.make_mla_attention(SPEC)
    assert op.prolog_reasons(HE, HCQ, BF) == []
    assert any("7168" in r for r in op.prolog_reasons(5120, HCQ, BF))  # DeepSeek-V2's hidden size
    assert any("bf16" in r for r in op.prolog_reasons(HE, HCQ, torch.float16))
    assert NativeOps().make_mla_attention(SPEC).prolog_reasons(HE, HCQ, BF)  # the contract's default: no prolog
    for i, case in enumerate(mla_prolog_cases(SPEC, HE, HCQ, 16, batches)):
        inputs = case.make(_g(i), BF)
        before = dict(fake_npu.CALLS)
        out = case.run(ascend, to_device(inputs, ascend.device))
        calls = {k: v - before.get(k, 0) for k, v in fake_npu.CALLS.items() if v != before.get(k, 0)}
        # only an all-decode batch with interleaved RoPE goes through the prolog (and it writes the cache)
        fused = case.name.startswith("from hidden (interleaved) decode")
        assert (calls.get("npu_mla_prolog_v3", 0) == 1) == fused, (case.name, calls)
        assert calls.get("npu_fused_infer_attention_score", 0) >= 1, (case.name, calls)
        if "halves" in case.name:  # the composition's cache write: the ND scatter (interleaved: the fused norm op)
            assert calls.get("npu_scatter_pa_kv_cache", 0) == 1, (case.name, calls)
        ref = case.run(_Reference(), inputs)
        for a, b in zip(out, ref):
            assert torch.allclose(a.float(), b.float(), atol=6e-2, rtol=5e-2), case.name


def test_padded_decode_rows_take_the_tnd_prolog_and_write_only_real_slots(ascend, fake_npu, prolog_inputs):
    op = ascend.make_mla_attention(SPEC)
    g = _g(3)
    op.load_kv_b_proj((torch.randn(2 * 256, 512, generator=g) * 512**-0.5).to(BF))
    from deepinfer.backend import MLAPrologWeights

    i = prolog_inputs
    w = MLAPrologWeights(q_a=i["w_dq"].t(), q_a_norm=i["g_cq"], q_b=i["w_uq_qr"].t(), kv_a=i["w_dkv_kr"].t(),
                         kv_a_norm=i["g_ckv"], eps=1e-6)
    op.load_prolog(w)
    batch = _mla_batch([1, 1], [4, 9], 16, 4, g)
    batch.slot_mapping["mla"] = torch.cat([batch.slot_mapping["mla"], torch.tensor([-1])])  # a padded third row
    batch.query_lens_cpu.append(1)
    batch.seq_lens_cpu.append(1)
    batch.context_lens_cpu.append(0)
    batch.block_tables["mla"] = torch.cat([batch.block_tables["mla"], batch.block_tables["mla"][:1]])
    latent, rope = torch.zeros(4, 16, 512, dtype=BF), torch.zeros(4, 16, 64, dtype=BF)
    rope_cache = rope_cos_sin_cache(64, 64, 10000.0, None)
    pos = torch.tensor([4, 9, 0])
    before = fake_npu.CALLS["npu_mla_prolog_v3"]
    op.forward_from_hidden(i["x"], pos, rope_cache, True, (latent, rope), batch, "mla", ascend)
    assert fake_npu.CALLS["npu_mla_prolog_v3"] == before + 1
    written = (latent.view(-1, 512).abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert sorted(written) == sorted(batch.slot_mapping["mla"][:2].tolist())  # the padded row wrote nothing


def _v3_mla_layer(backend, weights: dict[str, torch.Tensor]):
    """The model's MLA layer (models/layers/mla.py) at DeepSeek-V3 widths with 2 heads, loaded with `weights`."""
    from deepinfer.checkpoints import PRESETS
    from deepinfer.models.deepseek_v3.config import parse_deepseek_config
    from deepinfer.models.layers.mla import MLAAttention

    cfg = parse_deepseek_config(dict(PRESETS["tiny-v3"].config, hidden_size=HE, q_lora_rank=HCQ, kv_lora_rank=512,
                                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                     num_attention_heads=2, num_key_value_heads=2))
    layer = MLAAttention(cfg, 0, backend, BF)
    loaders = layer.loaders("attn")
    assert set(loaders) == set(weights)
    for name, t in weights.items():
        loaders[name](t)
    layer.finalize()
    return layer


def test_the_model_layer_hands_the_op_its_hidden_states(ascend, fake_npu):
    from deepinfer.backend import KVCaches, KVCacheSpec

    g = _g(4)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(BF)
    weights = {"attn.q_a_proj.weight": r(HCQ, HE, s=HE**-0.5), "attn.kv_a_proj_with_mqa.weight": r(576, HE, s=HE**-0.5),
               "attn.q_a_layernorm.weight": r(HCQ, s=0.3) + 1, "attn.q_b_proj.weight": r(384, HCQ, s=HCQ**-0.5),
               "attn.kv_a_layernorm.weight": r(512, s=0.3) + 1, "attn.kv_b_proj.weight": r(512, 512, s=512**-0.5),
               "attn.o_proj.weight": r(HE, 256, s=256**-0.5)}
    from deepinfer.backends.cpu.backend import CPUBackend

    native = CPUBackend()  # the cpu backend's ops (no prolog: the contract's default), its own MLA kernels
    layers = {"ascend": _v3_mla_layer(ascend, weights), "native": _v3_mla_layer(native, weights)}
    assert layers["ascend"].fused_prolog and layers["ascend"].qkv_a_proj is None  # the op owns the projections
    assert not layers["native"].fused_prolog and layers["native"].qkv_a_proj is not None
    spec = KVCacheSpec("mla", (0,), (576,), BF)
    rope_cache = rope_cos_sin_cache(64, 64, 10000.0, None)
    outs = {}
    for name, backend in (("ascend", ascend), ("native", native)):
        caches = KVCaches.allocate([spec], {"mla": 4}, 16, 4, torch.device("cpu"),
                                   layouts={"mla": backend.kv_cache_layout(spec)})
        prefill, decode = _mla_batch([6], [0], 16, 4, _g(5)), _mla_batch([1], [6], 16, 4, _g(5))
        x = r(7, HE) if name == "ascend" else outs["x"]
        outs["x"] = x
        before = fake_npu.CALLS["npu_mla_prolog_v3"]
        y0 = layers[name].forward(x[:6], prefill.positions, rope_cache, prefill, caches)
        y1 = layers[name].forward(x[6:], decode.positions, rope_cache, decode, caches)
        outs[name] = (torch.cat([y0, y1]), fake_npu.CALLS["npu_mla_prolog_v3"] - before)
    assert outs["ascend"][1] == 1 and outs["native"][1] == 0  # the decode step ran the prolog, the prefill did not
    assert torch.allclose(outs["ascend"][0].float(), outs["native"][0].float(), atol=5e-2, rtol=5e-2)


class _PrologModel:
    """One MLA layer from fixed hidden rows scaled by the step's input ids (so replays see new inputs)."""

    def __init__(self, op, backend, x):
        self.op, self.backend, self.x = op, backend, x
        self.rope_cache = rope_cos_sin_cache(64, 64, 10000.0, None)

    def forward(self, batch, caches):
        b = batch.input_ids.shape[0]
        x = self.x[:b] * (1 + batch.input_ids[:, None].to(BF) / 8)
        return self.op.forward_from_hidden(x, batch.positions, self.rope_cache, True, caches.get("mla", 0), batch,
                                           "mla", self.backend)


def test_decode_graphs_replay_the_prolog_equal_to_eager(ascend, fake_npu, prolog_inputs):
    from test_ascend_graphs import BS, NB, _decode_batch

    from deepinfer.backend import KVCaches, KVCacheSpec, MLAPrologWeights
    from deepinfer.backends.ascend.graph_runner import NPUGraphRunner

    g, i = _g(6), prolog_inputs
    op = ascend.make_mla_attention(SPEC)
    op.load_kv_b_proj((torch.randn(2 * 256, 512, generator=g) * 512**-0.5).to(BF))
    op.load_prolog(MLAPrologWeights(q_a=i["w_dq"].t(), q_a_norm=i["g_cq"], q_b=i["w_uq_qr"].t(),
                                    kv_a=i["w_dkv_kr"].t(), kv_a_norm=i["g_ckv"], eps=1e-6))
    spec = KVCacheSpec("mla", (0,), (576,), BF, components=(("latent", 512), ("rope", 64)))
    caches = KVCaches.allocate([spec], {"mla": NB}, BS, 4, torch.device("cpu"),
                               layouts={"mla": ascend.kv_cache_layout(spec)})
    for part in caches.get("mla", 0):
        part.copy_(torch.randn(part.shape, generator=g).to(BF))
    model = _PrologModel(op, ascend, torch.cat([i["x"], i["x"][:1]]))
    before = fake_npu.CALLS["npu_mla_prolog_v3"]
    runner = NPUGraphRunner.capture(model, caches, BS, 2 * BS, 4, torch.device("cpu"), buckets=[4])
    assert fake_npu.CALLS["npu_mla_prolog_v3"] >= before + 1  # captured (TND: the capture's rows are padding)
    for lens, ids in (([5, 9, 17], [1, 2, 3]), ([6, 10], [4, 5])):
        batch = _decode_batch(lens, ids)
        replayed = runner.run(batch).clone()
        cache_after_replay = [p.clone() for p in caches.get("mla", 0)]
        eager = model.forward(batch, caches)  # PA_BSND: every slot real, nothing captured
        # a replay runs the bucket's 4 rows, eager 3 or 2: the CPU matmuls may round the last bit differently
        assert torch.allclose(replayed.float(), eager.float(), atol=2e-2, rtol=1e-2), lens
        assert all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=1e-2)
                   for a, b in zip(cache_after_replay, caches.get("mla", 0)))
