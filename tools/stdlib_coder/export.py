"""Export a trained TrainingV3 as a DeepSeek-V3 checkpoint in the released models' format.

Like DeepSeek's releases: every linear weight of attention, dense MLP, routed and shared experts and the
MTP's eh_proj is stored as fp8 e4m3 with one fp32 `weight_scale_inv` per 128x128 block; the embedding, the
LM head, the router gate, norms and the correction bias stay dense (bf16, the bias fp32). The MTP module
sits at layer index num_hidden_layers with its own `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`; its
embedding and output head are the main model's (the report shares them), so the checkpoint stores them
once and the loaders share them.
"""

from __future__ import annotations

import json
import os

import torch

from deepinfer.backend.native.linear import dequant_fp8_block
from deepinfer.checkpoints.random_weights import quantize_fp8_block
from tools.stdlib_coder.model import GatedMLP, MoE, TrainingV3, V3Shape

DENSE_DTYPE = torch.bfloat16
KEEP_FP32 = ("e_score_correction_bias", "weight_scale_inv")


def hf_config(shape: V3Shape) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_nextn_predict_layers": shape.num_nextn_predict_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_attention_heads,
        "q_lora_rank": shape.q_lora_rank,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_nope_head_dim": shape.qk_nope_head_dim,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "n_routed_experts": shape.n_routed_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "n_shared_experts": shape.n_shared_experts,
        "first_k_dense_replace": shape.first_k_dense_replace,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": shape.n_group,
        "topk_group": shape.topk_group,
        "norm_topk_prob": shape.norm_topk_prob,
        "routed_scaling_factor": shape.routed_scaling_factor,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": shape.rope_scaling,
        "rope_interleave": True,
        "max_position_embeddings": shape.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    }


def _dense(w: torch.Tensor) -> torch.Tensor:
    return w.detach().float().cpu()  # cast to the storage dtype in write_checkpoint


def _linear(out: dict, name: str, w: torch.Tensor, fp8: bool) -> None:
    if fp8:
        q, s = quantize_fp8_block(w.detach().float().cpu())
        out[f"{name}.weight"] = q
        out[f"{name}.weight_scale_inv"] = s
    else:
        out[f"{name}.weight"] = _dense(w)


def _norm(out: dict, name: str, w: torch.Tensor) -> None:
    out[f"{name}.weight"] = _dense(w)


def _layer(out: dict, p: str, layer, fp8: bool) -> None:
    _norm(out, f"{p}.input_layernorm", layer.input_layernorm.weight)
    _norm(out, f"{p}.post_attention_layernorm", layer.post_attention_layernorm.weight)
    a = layer.self_attn
    for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        _linear(out, f"{p}.self_attn.{n}", getattr(a, n).weight, fp8)
    _norm(out, f"{p}.self_attn.q_a_layernorm", a.q_a_layernorm.weight)
    _norm(out, f"{p}.self_attn.kv_a_layernorm", a.kv_a_layernorm.weight)
    m = layer.mlp
    if isinstance(m, GatedMLP):
        _mlp(out, f"{p}.mlp", m, fp8)
        return
    assert isinstance(m, MoE)
    out[f"{p}.mlp.gate.weight"] = _dense(m.gate_weight)
    out[f"{p}.mlp.gate.e_score_correction_bias"] = m.e_score_correction_bias.detach().float().cpu()
    for e in range(m.w_gate.shape[0]):
        _linear(out, f"{p}.mlp.experts.{e}.gate_proj", m.w_gate[e], fp8)
        _linear(out, f"{p}.mlp.experts.{e}.up_proj", m.w_up[e], fp8)
        _linear(out, f"{p}.mlp.experts.{e}.down_proj", m.w_down[e], fp8)
    _mlp(out, f"{p}.mlp.shared_experts", m.shared_experts, fp8)


def _mlp(out: dict, p: str, m: GatedMLP, fp8: bool) -> None:
    for n in ("gate_proj", "up_proj", "down_proj"):
        _linear(out, f"{p}.{n}", getattr(m, n).weight, fp8)


def checkpoint_tensors(model: TrainingV3, fp8: bool = True) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = _dense(model.embed_tokens.weight)
    for i, layer in enumerate(model.layers):
        _layer(out, f"model.layers.{i}", layer, fp8)
    _norm(out, "model.norm", model.norm.weight)
    out["lm_head.weight"] = _dense(model.lm_head.weight)
    for k, mtp in enumerate(model.mtp):
        p = f"model.layers.{model.c.num_hidden_layers + k}"
        _layer(out, p, mtp.block, fp8)
        _norm(out, f"{p}.enorm", mtp.enorm.weight)
        _norm(out, f"{p}.hnorm", mtp.hnorm.weight)
        _linear(out, f"{p}.eh_proj", mtp.eh_proj.weight, fp8)
        _norm(out, f"{p}.shared_head.norm", mtp.shared_head_norm.weight)
    return out


def write_checkpoint(model: TrainingV3, out_dir: str, fp8: bool = True, dense_dtype: torch.dtype = DENSE_DTYPE) -> None:
    """fp8=True, bf16: the shipped format. fp8=False with float32: an exact copy for parity tests."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    cfg = hf_config(model.c)
    if not fp8:
        cfg.pop("quantization_config")
    cfg["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dense_dtype]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, f, indent=2)
    tensors = {}
    for name, t in sorted(checkpoint_tensors(model, fp8).items()):
        if t.dtype == torch.float32 and not name.endswith(KEEP_FP32):
            t = t.to(dense_dtype)
        tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_into(model: TrainingV3, ckpt_dir: str) -> None:
    """Fill a TrainingV3 from a checkpoint written by write_checkpoint (fp8 dequantized to fp32), so the
    evaluation runs on exactly the shipped weights."""
    from safetensors.torch import load_file

    t = load_file(os.path.join(ckpt_dir, "model.safetensors"))

    def w(name: str) -> torch.Tensor:
        q = t[f"{name}.weight"]
        s = t.get(f"{name}.weight_scale_inv")
        return q.float() if s is None else dequant_fp8_block(q, s)  # the engine's own dequantization

    def layer(p: str, lyr) -> None:
        sd = {"input_layernorm.weight": w(f"{p}.input_layernorm"),
              "post_attention_layernorm.weight": w(f"{p}.post_attention_layernorm")}
        for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_layernorm",
                  "kv_a_layernorm"):
            sd[f"self_attn.{n}.weight"] = w(f"{p}.self_attn.{n}")
        if isinstance(lyr.mlp, MoE):
            E = lyr.mlp.w_gate.shape[0]
            sd["mlp.gate_weight"] = w(f"{p}.mlp.gate")
            sd["mlp.e_score_correction_bias"] = t[f"{p}.mlp.gate.e_score_correction_bias"].float()
            for k, n in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                sd[f"mlp.{k}"] = torch.stack([w(f"{p}.mlp.experts.{e}.{n}") for e in range(E)])
                sd[f"mlp.shared_experts.{n}.weight"] = w(f"{p}.mlp.shared_experts.{n}")
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[f"mlp.{n}.weight"] = w(f"{p}.mlp.{n}")
        missing, unexpected = lyr.load_state_dict(sd, strict=False)
        assert not unexpected and not missing, (missing, unexpected)

    with torch.no_grad():
        model.embed_tokens.weight.copy_(w("model.embed_tokens"))
        model.norm.weight.copy_(w("model.norm"))
        model.lm_head.weight.copy_(w("lm_head"))
        for i, lyr in enumerate(model.layers):
            layer(f"model.layers.{i}", lyr)
        for k, mtp in enumerate(model.mtp):
            p = f"model.layers.{model.c.num_hidden_layers + k}"
            layer(p, mtp.block)
            for n in ("enorm", "hnorm", "eh_proj"):
                getattr(mtp, n).weight.copy_(w(f"{p}.{n}"))
            mtp.shared_head_norm.weight.copy_(w(f"{p}.shared_head.norm"))
