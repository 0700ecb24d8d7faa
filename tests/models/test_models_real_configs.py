"""Published DeepSeek configs (V2-Lite, V2, V3 / R1) parse to the right variant, and at their real sizes the
model expects exactly the tensors our checkpoint writer produces (checked by name, nothing allocated)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.checkpoints.random_weights import deepseek_v3_tensor_plan
from deepinfer.models.deepseek_v3.model import DeepseekV2ForCausalLM

_YARN_V2 = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096, "type": "yarn"}
_COMMON = {"attention_bias": False, "hidden_act": "silu", "kv_lora_rank": 512, "max_position_embeddings": 163840,
           "moe_layer_freq": 1, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

V2_LITE = {**_COMMON, "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
           "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_hidden_layers": 27, "n_routed_experts": 64,
           "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
           "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "q_lora_rank": None,
           "first_k_dense_replace": 1, "vocab_size": 102400, "rope_scaling": _YARN_V2}
V2 = {**_COMMON, "model_type": "deepseek_v2", "hidden_size": 5120, "intermediate_size": 12288,
      "moe_intermediate_size": 1536, "num_attention_heads": 128, "num_hidden_layers": 60, "n_routed_experts": 160,
      "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 8, "topk_group": 3,
      "topk_method": "group_limited_greedy", "scoring_func": "softmax", "norm_topk_prob": False,
      "routed_scaling_factor": 16.0, "q_lora_rank": 1536, "first_k_dense_replace": 1, "vocab_size": 102400,
      "rope_scaling": _YARN_V2}
V3 = {**_COMMON, "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
      "moe_intermediate_size": 2048, "num_attention_heads": 128, "num_hidden_layers": 61, "n_routed_experts": 256,
      "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
      "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "q_lora_rank": 1536,
      "first_k_dense_replace": 3, "vocab_size": 129280, "num_nextn_predict_layers": 1,
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": [128, 128]},
      "rope_scaling": {**_YARN_V2, "mscale": 1.0, "mscale_all_dim": 1.0}}


@pytest.mark.parametrize(
    "hf,router,quant",
    [
        (V2_LITE, ("softmax", "greedy", 1, 1, 6, 1.0), None),
        (V2, ("softmax", "group_limited_greedy", 8, 3, 6, 16.0), None),
        (V3, ("sigmoid", "noaux_tc", 8, 4, 8, 2.5), "fp8_block"),
    ],
    ids=["v2-lite", "v2", "v3"],
)
def test_real_config_builds_and_expects_the_published_tensor_names(hf, router, quant):
    model = DeepseekV2ForCausalLM(hf, CPUBackend(), torch.bfloat16)  # weights arrive only at load time
    r = model.config.router_spec()
    assert (r.scoring_func, r.topk_method, r.n_group, r.topk_group, r.top_k, r.routed_scaling_factor) == router
    assert model.quantization == quant
    (spec,) = model.kv_cache_specs()
    assert spec.entry_shape == (576,) and len(spec.layer_ids) == hf["num_hidden_layers"]
    expected = set(model.weight_loaders())
    written = set()
    for s in deepseek_v3_tensor_plan(hf, quant is not None):
        written.add(s.name)
        if s.fp8:
            written.add(s.scale_name())
    assert expected == written
    assert model.is_mtp_weight(f"model.layers.{hf['num_hidden_layers']}.eh_proj.weight")
    assert not model.is_mtp_weight("model.layers.0.self_attn.o_proj.weight")
