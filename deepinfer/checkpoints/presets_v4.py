"""DeepSeek-V4 checkpoint presets: "tiny-v4" (tests) and "v4-flash-reduced" (V4-Flash shapes, few layers).

Tensors are named as DeepSeek publishes V4 (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, `mtp.0.*`, ...), which is what transformers'
deepseek_v4 conversion mapping reads, so the reference loads these files as they are.
The layer schedule is given both as `compress_ratios` (with the MTP layer's entry
past num_hidden_layers) and as `layer_types` (what the reference reads when the
ratios are not its 0 / 4 / 128).
"""

from __future__ import annotations

import torch

from deepinfer.checkpoints.presets import Preset, register_preset
from deepinfer.checkpoints.random_weights import TensorSpec


def v4_config(*, vocab, hidden, layers_ratios, mtp_ratios, hash_layers, heads, head_dim, rope_dim, q_lora,
               o_groups, o_lora, experts, top_k, moe_inter, window, csa, hca, index_heads, index_dim, index_topk,
               yarn_factor, yarn_original, max_pos) -> dict:
    """A DeepSeek-V4 config.json (transformers' field names) from its shapes: the presets below, and
    tools/stdlib_coder/v4_model.py's trained small V4."""
    types = {0: "sliding_attention", csa: "compressed_sparse_attention", hca: "heavily_compressed_attention"}
    n = len(layers_ratios)
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": n,
        "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": head_dim,
        "qk_rope_head_dim": rope_dim, "q_lora_rank": q_lora, "o_groups": o_groups, "o_lora_rank": o_lora,
        "compress_ratios": list(layers_ratios) + list(mtp_ratios),
        "layer_types": [types[r] for r in layers_ratios],
        "compress_rates": {"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        "mlp_layer_types": ["hash_moe"] * hash_layers + ["moe"] * (n - hash_layers),
        "n_routed_experts": experts, "num_experts_per_tok": top_k, "n_shared_experts": 1,
        "moe_intermediate_size": moe_inter, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "sliding_window": window, "index_n_heads": index_heads, "index_head_dim": index_dim, "index_topk": index_topk,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_parameters": {"rope_type": "yarn", "factor": yarn_factor, "original_max_position_embeddings": yarn_original,
                            "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": max_pos, "num_nextn_predict_layers": len(mtp_ratios),
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "initializer_range": 0.02, "use_cache": True,
    }


def _block(cfg: dict, p: str, ratio: int, hash_layer: bool, fp8: bool) -> list[TensorSpec]:
    """One decoder block (main layer or MTP layer) in DeepSeek's naming."""
    D, H, Dh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, G, ol = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    E, k, inter, V = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    Hi, Di = cfg["index_n_heads"], cfg["index_head_dim"]
    n = cfg["hc_mult"]
    f32 = torch.float32

    def lin(name, out_f, in_f, q=fp8):
        return TensorSpec(f"{name}.weight", (out_f, in_f), std=in_f ** -0.5, fp8=q)

    def norm(name, size):
        return TensorSpec(f"{name}.weight", (size,), std=0.1, kind="norm", dtype=f32)

    a = f"{p}.attn"
    specs = [lin(f"{a}.wq_a", ql, D), norm(f"{a}.q_norm", ql), lin(f"{a}.wq_b", H * Dh, ql),
             lin(f"{a}.wkv", Dh, D), norm(f"{a}.norm", Dh), lin(f"{a}.wo_a", G * ol, H * Dh // G),
             lin(f"{a}.wo_b", D, G * ol), TensorSpec(f"{a}.attn_sink", (H,), std=0.5, dtype=f32)]
    if ratio:
        csa = ratio == cfg["compress_rates"]["compressed_sparse_attention"]
        w = (2 if csa else 1) * Dh
        c = f"{a}.compressor"
        specs += [lin(f"{c}.wkv", w, D, q=False), lin(f"{c}.wgate", w, D, q=False),
                  TensorSpec(f"{c}.ape", (ratio, w), std=0.5, dtype=f32), norm(f"{c}.norm", Dh)]
        if csa:
            i = f"{a}.indexer"
            specs += [lin(f"{i}.wq_b", Hi * Di, ql), lin(f"{i}.weights_proj", Hi, D, q=False),
                      lin(f"{i}.compressor.wkv", 2 * Di, D, q=False), lin(f"{i}.compressor.wgate", 2 * Di, D, q=False),
                      TensorSpec(f"{i}.compressor.ape", (ratio, 2 * Di), std=0.5, dtype=f32),
                      norm(f"{i}.compressor.norm", Di)]
    f = f"{p}.ffn"
    specs.append(TensorSpec(f"{f}.gate.weight", (E, D), std=D ** -0.5))
    if hash_layer:
        specs.append(TensorSpec(f"{f}.gate.tid2eid", (V, k), kind="expert_table", std=float(E), dtype=torch.int64))
    else:
        specs.append(TensorSpec(f"{f}.gate.bias", (E,), std=0.1, dtype=f32))
    for e in range(E):
        specs += [lin(f"{f}.experts.{e}.w1", inter, D), lin(f"{f}.experts.{e}.w3", inter, D),
                  lin(f"{f}.experts.{e}.w2", D, inter)]
    specs += [lin(f"{f}.shared_experts.w1", inter, D), lin(f"{f}.shared_experts.w3", inter, D),
              lin(f"{f}.shared_experts.w2", D, inter)]
    specs += [norm(f"{p}.attn_norm", D), norm(f"{p}.ffn_norm", D)]
    for tag in ("attn", "ffn"):
        specs += [TensorSpec(f"{p}.hc_{tag}_fn", ((2 + n) * n, n * D), std=(n * D) ** -0.5, dtype=f32),
                  TensorSpec(f"{p}.hc_{tag}_base", ((2 + n) * n,), std=0.5, dtype=f32),
                  TensorSpec(f"{p}.hc_{tag}_scale", (3,), std=0.1, kind="norm", dtype=f32)]
    return specs


def _hc_head(prefix: str, n: int, D: int) -> list[TensorSpec]:
    """The final hyper-connection collapse of the model (prefix "") or of an MTP layer ("mtp.J.")."""
    f32 = torch.float32
    return [TensorSpec(f"{prefix}hc_head_fn", (n, n * D), std=(n * D) ** -0.5, dtype=f32),
            TensorSpec(f"{prefix}hc_head_base", (n,), std=0.5, dtype=f32),
            TensorSpec(f"{prefix}hc_head_scale", (1,), std=0.1, kind="norm", dtype=f32)]


def v4_tensor_plan(cfg: dict, fp8: bool) -> list[TensorSpec]:
    """Every tensor of a DeepSeek-V4 checkpoint (main layers, head, and the MTP layers kept aside)."""
    D, V, n = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    f32 = torch.float32
    L = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"]
    n_hash = cfg["mlp_layer_types"].count("hash_moe")
    specs = [TensorSpec("embed.weight", (V, D), std=1.0)]
    for i in range(L):
        specs += _block(cfg, f"layers.{i}", ratios[i], cfg["mlp_layer_types"][i] == "hash_moe", fp8)
    specs += [TensorSpec("norm.weight", (D,), std=0.1, kind="norm", dtype=f32),
              *_hc_head("", n, D),
              TensorSpec("head.weight", (V, D), std=2.0 * D ** -0.5)]
    for j, r in enumerate(ratios[L:]):
        p = f"mtp.{j}"
        specs += _block(cfg, p, r, n_hash > L, fp8)
        specs += [TensorSpec(f"{p}.enorm.weight", (D,), std=0.1, kind="norm", dtype=f32),
                  TensorSpec(f"{p}.hnorm.weight", (D,), std=0.1, kind="norm", dtype=f32),
                  TensorSpec(f"{p}.e_proj.weight", (D, D), std=D ** -0.5, fp8=fp8),  # (fp8 in the release)
                  TensorSpec(f"{p}.h_proj.weight", (D, D), std=D ** -0.5, fp8=fp8),
                  TensorSpec(f"{p}.norm.weight", (D,), std=0.1, kind="norm", dtype=f32),
                  *_hc_head(f"{p}.", n, D)]
    return specs


def tiny_v4_config() -> dict:
    """SWA, CSA (m=4) and HCA (m=16) layers, W=8, one hash-MoE layer, 8 indexer heads, one MTP layer."""
    return v4_config(vocab=1024, hidden=64, layers_ratios=(0, 4, 16, 4), mtp_ratios=(4,), hash_layers=1,
                      heads=4, head_dim=32, rope_dim=8, q_lora=32, o_groups=2, o_lora=16, experts=8, top_k=2,
                      moe_inter=32, window=8, csa=4, hca=16, index_heads=8, index_dim=16, index_topk=4,
                      yarn_factor=4.0, yarn_original=64, max_pos=4096)


def v4_flash_ratios(num_layers: int = 43) -> tuple[int, ...]:
    """Assumed V4-Flash schedule: 2 sliding-window layers, then CSA (m=4) and HCA (m=128) alternating.

    (43 layers: 21 CSA, 20 HCA, which gives the published ~6.9 KB/token; see docs/v4.md.)
    """
    return tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(num_layers))


def v4_flash_config(num_layers: int = 43) -> dict:
    """V4-Flash shapes (hidden 4096, 64 heads of 512, 256 experts, W=128, m=4 / 128)."""
    return v4_config(vocab=129280, hidden=4096, layers_ratios=v4_flash_ratios(num_layers), mtp_ratios=(0,),
                      hash_layers=min(3, num_layers),
                      heads=64, head_dim=512, rope_dim=64, q_lora=1024, o_groups=8, o_lora=1024, experts=256,
                      top_k=6, moe_inter=2048, window=128, csa=4, hca=128, index_heads=64, index_dim=128,
                      index_topk=512, yarn_factor=16.0, yarn_original=65536, max_pos=1048576)


def v4_flash_reduced_config(num_layers: int = 4) -> dict:
    """V4-Flash per-layer shapes with the first `num_layers` layers (4: SWA, SWA, CSA, HCA)."""
    return v4_flash_config(num_layers)


for _p in (
    Preset("tiny-v4", "tiny DeepSeek-V4 (SWA + CSA m=4 + HCA m=16 layers, W=8, hash-MoE, mHC, MTP layer), fp32",
           tiny_v4_config(), dtype="float32", tensor_plan=v4_tensor_plan),
    Preset("v4-flash-reduced", "DeepSeek-V4-Flash shapes with 4 layers (SWA, SWA, CSA, HCA; +1 MTP), fp8 linears, bf16, ~35 GB",
           v4_flash_reduced_config(), dtype="bfloat16", fp8=True, max_shard_bytes=5 * 1024**3,
           tensor_plan=v4_tensor_plan),
):
    register_preset(_p)
