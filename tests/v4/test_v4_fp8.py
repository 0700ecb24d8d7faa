"""tiny-v4 with fp8 e4m3 128x128 block-quantized linears (as V4 releases ship attention / expert weights).

Our model loads the fp8 tensors with their weight_scale_inv; the reference loads the same
weights dequantized (q * scale) into fp32. Logits must agree.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from v4_helpers import hf_logits, load_hf, load_ours, run_chunks

from deepinfer.checkpoints.presets_v4 import tiny_v4_config, v4_tensor_plan
from deepinfer.checkpoints.random_weights import write_safetensors

FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_fp8_block_linears_match_dequantized_reference(tmp_path):
    cfg = {**tiny_v4_config(), "torch_dtype": "float32"}
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    fp8_dir.mkdir()
    ref_dir.mkdir()
    with open(fp8_dir / "config.json", "w") as f:
        json.dump({**cfg, "quantization_config": FP8_QUANT}, f)
    with open(ref_dir / "config.json", "w") as f:
        json.dump(cfg, f)
    write_safetensors(str(fp8_dir), v4_tensor_plan(cfg, True), 0, torch.float32)
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    n_fp8 = 0
    dense = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            n_fp8 += 1
            s = tensors[name[: -len("weight")] + "weight_scale_inv"]
            s = s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
            t = t.float() * s
        dense[name] = t.contiguous()
    assert n_fp8 > 50
    save_file(dense, os.path.join(ref_dir, "model.safetensors"))

    ours = load_ours(str(fp8_dir))
    assert ours.quantization == "fp8_block"
    hf = load_hf(str(ref_dir))
    ids = torch.randint(2, 1024, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(run_chunks(ours, ids, [5, 7]), ref, atol=2e-5, rtol=0)

    # DeepSeek's own naming of the block scales: `<linear>.scale`
    renamed = {(n[: -len("weight_scale_inv")] + "scale" if n.endswith("weight_scale_inv") else n): t
               for n, t in tensors.items()}
    save_file(renamed, os.path.join(fp8_dir, "model.safetensors"))
    torch.testing.assert_close(run_chunks(load_ours(str(fp8_dir)), ids, [37]), ref, atol=2e-5, rtol=0)
