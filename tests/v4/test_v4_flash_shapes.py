"""V4-Flash attention shapes (head_dim 512, rope 64, W=128, m=4 / m'=128, 64 indexer heads of 128) on a
narrow two-layer model, against the reference: full prefill and uneven chunks across 128-token windows."""

from __future__ import annotations

import json

import torch
from v4_helpers import hf_logits, load_hf, load_ours, run_chunks

from deepinfer.checkpoints.presets_v4 import v4_config, v4_tensor_plan
from deepinfer.checkpoints.random_weights import write_safetensors


def test_flash_attention_shapes_prefill_and_chunks(tmp_path):
    cfg = v4_config(vocab=512, hidden=128, layers_ratios=(4, 128), mtp_ratios=(), hash_layers=1, heads=8,
                     head_dim=512, rope_dim=64, q_lora=64, o_groups=4, o_lora=32, experts=4, top_k=2, moe_inter=32,
                     window=128, csa=4, hca=128, index_heads=64, index_dim=128, index_topk=24, yarn_factor=16.0,
                     yarn_original=128, max_pos=65536)
    cfg["torch_dtype"] = "float32"
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    write_safetensors(str(tmp_path), v4_tensor_plan(cfg, False), 0, torch.float32)
    hf, ours = load_hf(str(tmp_path)), load_ours(str(tmp_path))
    ids = torch.randint(2, 512, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(run_chunks(ours, ids, [300], block_size=16), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(run_chunks(ours, ids, [97, 131, 1, 1, 1], block_size=16), ref, atol=2e-5, rtol=0)
