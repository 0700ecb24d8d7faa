"""Bandwidth roofline of a DeepSeek V2/V3 decode step: the fewest bytes one step must read.

Per step every dense weight is read once, each routed expert that at least
one token picks is read once (expected distinct experts for B tokens picking
k of E uniformly: E * (1 - (1 - k/E)^B)), and every sequence reads its whole
latent KV cache (layers * (kv_lora_rank + qk_rope) elements per token). The
floor is those bytes over the measured device bandwidth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class DecodeBytes:
    dense_weights: float
    routed_experts: float
    kv_cache: float

    @property
    def total(self) -> float:
        return self.dense_weights + self.routed_experts + self.kv_cache


def decode_step_bytes(cfg: dict, batch: int, context: int, elem_bytes: int = 2) -> DecodeBytes:
    h = cfg["hidden_size"]
    layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    lora = cfg["kv_lora_rank"]
    q_lora = cfg.get("q_lora_rank")
    q_params = h * heads * (nope + rope) if not q_lora else h * q_lora + q_lora * heads * (nope + rope)
    attn = q_params + h * (lora + rope) + lora * heads * (nope + v) + heads * v * h
    dense_layers = cfg.get("first_k_dense_replace", 0)
    experts = cfg["n_routed_experts"]
    k = cfg["num_experts_per_tok"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    shared = cfg.get("n_shared_experts", 0) * expert
    dense_mlp = 3 * h * cfg["intermediate_size"]
    moe_layers = layers - dense_layers
    lm_head = cfg["vocab_size"] * h
    dense = layers * attn + dense_layers * dense_mlp + moe_layers * (shared + experts * h) + lm_head
    touched = experts * (1 - (1 - k / experts) ** batch)
    routed = moe_layers * touched * expert
    kv = batch * context * layers * (lora + rope)
    return DecodeBytes(dense * elem_bytes, routed * elem_bytes, kv * elem_bytes)


def floor_ms(cfg: dict, batch: int, context: int, bandwidth_tbs: float) -> float:
    return decode_step_bytes(cfg, batch, context).total / (bandwidth_tbs * 1e12) * 1e3


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("config", help="config.json of the model")
    p.add_argument("--bandwidth-tbs", type=float, default=4.24, help="measured device bandwidth, TB/s")
    p.add_argument("--context", type=int, default=1536)
    args = p.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    for b in (1, 16, 64, 256):
        by = decode_step_bytes(cfg, b, args.context)
        ms = by.total / (args.bandwidth_tbs * 1e12) * 1e3
        print(json.dumps({"bench": "roofline", "batch": b, "context": args.context, "GB_per_step": by.total / 1e9,
                          "floor_ms_per_step": ms, "ceiling_tok_s": b / ms * 1e3}))
