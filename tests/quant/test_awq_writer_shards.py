"""deepinfer/checkpoints/awq_writer.py on a sharded checkpoint (V2-Lite's random checkpoint is 7 shards of 5 GB):
shard by shard, an index naming every written tensor, the same model as a copy written from one file."""

from __future__ import annotations

import json
import os
import shutil

import torch
from quant_testutil import prefill_logits

from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.checkpoints.awq_writer import main as awq_main
from deepinfer.models.registry import load_model


def _split(src: str, dst: str) -> None:
    """src's single model.safetensors as two shards + an index (alternate tensors), other files copied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    os.makedirs(dst)
    shards = {"model-00001-of-00002.safetensors": names[0::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, os.path.join(dst, shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: s for s, part in shards.items() for n in part}}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    for extra in os.listdir(src):
        if extra != "model.safetensors":
            shutil.copy(os.path.join(src, extra), os.path.join(dst, extra))


def test_sharded_checkpoint_gives_the_same_int4_model(tiny_v3_dir, tmp_path):
    sharded = str(tmp_path / "sharded")
    _split(tiny_v3_dir, sharded)
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    assert awq_main([tiny_v3_dir, one, "--method", "gptq", "--group-size", "64"]) == 0
    assert awq_main([sharded, many, "--method", "gptq", "--group-size", "64"]) == 0
    with open(os.path.join(many, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    from safetensors import safe_open

    for shard in set(weight_map.values()):
        with safe_open(os.path.join(many, shard), framework="pt") as f:
            assert {n for n, s in weight_map.items() if s == shard} == set(f.keys())
    assert any(n.endswith(".qweight") for n in weight_map) and any(n.endswith(".g_idx") for n in weight_map)
    with open(os.path.join(many, "config.json")) as f:
        assert json.load(f)["quantization_config"]["group_size"] == 64
    be = CPUBackend()
    a, b = (load_model(p, be, torch.float32, progress=False) for p in (one, many))
    moes = [m for m in b.modules() if type(m).__name__ == "MoELayer"]
    assert moes and all(m.quantized_experts and m.op.quant.group_size == 64 for m in moes)
    ids = torch.randint(2, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(prefill_logits(a, be, ids), prefill_logits(b, be, ids))


def test_act_order_copy_loads_as_act_order_and_gives_the_model_of_its_weights(tiny_v3_dir, tmp_path):
    """`--act-order`: GPTQ records whose g_idx is a permutation of k // G (the same for gate / up, and for q / kv_a),
    loaded with the routed experts int4 (the op's act-order layout); its logits equal those of the same weights
    written dense (each record dequantized by its own g_idx, the reference's arithmetic); AWQ refuses it."""
    import pytest
    from safetensors.torch import load_file, save_file

    from deepinfer.backend import Int4Weight, dequant_int4

    act = str(tmp_path / "act")
    assert awq_main([tiny_v3_dir, act, "--method", "gptq", "--group-size", "32", "--act-order"]) == 0
    with open(os.path.join(act, "config.json")) as f:
        assert json.load(f)["quantization_config"]["desc_act"] is True
    t = load_file(os.path.join(act, "model.safetensors"))
    p = "model.layers.1.mlp.experts.0"
    g_gate, g_up, g_down = (t[f"{p}.{x}.g_idx"] for x in ("gate_proj", "up_proj", "down_proj"))
    k = g_gate.numel()
    assert torch.equal(g_gate, g_up) and not torch.equal(g_gate.long(), torch.arange(k) // 32)
    assert torch.equal(torch.bincount(g_gate.long()), torch.full((k // 32,), 32))  # G channels a group
    dense = {}
    for name, v in t.items():
        if name.endswith(".qweight"):
            pre = name[: -len(".qweight")]
            rec = Int4Weight("gptq", v, t[f"{pre}.qzeros"], t[f"{pre}.scales"], t[f"{pre}.g_idx"], 32, 1)
            dense[f"{pre}.weight"] = dequant_int4(rec).contiguous()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            dense[name] = v
    twin = str(tmp_path / "twin")
    shutil.copytree(tiny_v3_dir, twin)
    save_file(dense, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    be = CPUBackend()
    a, b = (load_model(path, be, torch.float32, progress=False) for path in (act, twin))
    moes = [m for m in a.modules() if type(m).__name__ == "MoELayer"]
    assert moes and all(m.quantized_experts and m.op.quant.w13_g_idx is not None for m in moes)
    ids = torch.randint(2, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(prefill_logits(a, be, ids), prefill_logits(b, be, ids), atol=2e-4, rtol=2e-4)
    with pytest.raises(SystemExit):
        awq_main([tiny_v3_dir, str(tmp_path / "awq"), "--act-order"])
