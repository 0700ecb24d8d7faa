"""Speculation benchmark checkpoints: a DeepSeek-V3 model with one MTP module whose drafts are accepted at a set
rate, at real DeepSeek-V2-Lite layer shapes ("v2-lite-mtp-bench") and tiny ones for tests ("tiny-mtp-bench").

Why. Issue 17's benchmark asks for the speculation modes at V2-Lite shapes with an MTP layer on the H200, or on the
trained model. The trained model (the embedded stdlib-coder, hidden 256) runs host-bound steps on a GPU, where the
adaptive mode's host bookkeeping is most of what separates it from static k; a random V2-Lite checkpoint runs
device-bound steps but its MTP module's drafts are random (nothing is accepted). These checkpoints keep the real
layer shapes (every GEMM, attention and MoE kernel runs at V2-Lite's sizes, so a step costs what it costs there) and
give the MTP module drafts the main model accepts at a known rate, by construction rather than training:

- every decoder layer's output projections are zero (all linear weights are; the router's gate is random, so
  routing spreads over the experts as a random model's does), so the main model's final hidden state at a token is
  that token's embedding, and its greedy next token is f(t) = argmax lm_head . rms_norm(embed(t)): a fixed random
  function of the last token;
- the MTP module (layer id num_hidden_layers) reads x = eh_proj [rms_norm(embed(t_next)); rms_norm(h)] with eh_proj
  = [I + N | 0], N normal noise of std `noise / sqrt(hidden)`, and its decoder layer is zero as well, so its draft
  for the token after t_next is argmax lm_head . rms_norm((I + N) rms_norm(embed(t_next))): f(t_next) where the
  noise does not move the argmax. Every chained draft is drafted the same way from the token before it, so each
  drafted position is accepted (given the ones before it were) with about the same probability, set by `noise`:
  ~0.85 at V2-Lite's hidden 2048 with logits of std 8 (`LOGIT_STD`: lm_head's std 8 / sqrt(hidden)), measured
  by tests/spec/test_mtp_bench_checkpoint.py on the tiny preset and printed by the benchmark on the large one.

What it is not: a language model. Greedy output follows f from the prompt's last token into one of f's cycles
(a few hundred tokens at vocab 102400); the drafts' confidences are the MTP head's softmax maxima, which are lower
where the noise brings a near tie (so the calibration has a signal, not the trained model's). "v2-lite-mtp-bench" has
8 decoder layers (V2-Lite has 27) so that the benchmark's engines, one per mode each with its own copy of the
weights, fit one 80 GB GPU: ~10 GB each. That depth weighs the MTP module (one decoder layer and the 102400-row
head a drafted token) against a main model a third of V2-Lite's: on an H100 (session 43) every static draft length
ran below no speculation there. "v2-lite-mtp-bench-27l" has V2-Lite's 27 (~31 GB): two engines a process
(scripts/gpu_run.sh specbench with SPECB_SPLIT=1 runs off and one mode a process).
"""

from __future__ import annotations

from deepinfer.checkpoints.presets import Preset, _common, _yarn, register_preset
from deepinfer.checkpoints.random_weights import TensorSpec, deepseek_v3_tensor_plan

LOGIT_STD = 8.0  # lm_head's std times sqrt(hidden): the logits' std over the vocabulary for a unit-rms state


def mtp_bench_config(*, vocab: int, hidden: int, inter: int, moe_inter: int, layers: int, heads: int, kv_lora: int,
                     nope: int, rope: int, vdim: int, experts: int, top_k: int, shared: int, noise: float) -> dict:
    """A DeepSeek-V3 config.json (no q compression, V3's sigmoid routing in one group, one MTP module) with the MTP
    module's noise recorded under `mtp_bench_noise` (the tensor plan reads it; the model ignores it)."""
    return {
        **_common("deepseek_v3", "DeepseekV3ForCausalLM"),
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
        "num_hidden_layers": layers, "num_nextn_predict_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": None, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
        "v_head_dim": vdim, "n_routed_experts": experts, "num_experts_per_tok": top_k, "n_shared_experts": shared,
        "first_k_dense_replace": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 8192, "rope_scaling": _yarn(4.0, 2048, 0.707, 0.707),
        "mtp_bench_noise": noise,
    }


def mtp_bench_tensor_plan(cfg: dict, fp8: bool) -> list[TensorSpec]:
    """The main model's tensors (deepseek_v3_tensor_plan's names and shapes) with zero linears but the router, unit
    norms and lm_head of std LOGIT_STD / sqrt(hidden); then the MTP module's (module docstring)."""
    if fp8:
        raise ValueError("the MTP benchmark checkpoints are bf16 / fp32 only")
    D = cfg["hidden_size"]
    n = cfg["num_hidden_layers"]
    # the MTP module's decoder layer: the main plan's tensors of a model one layer deeper, its last layer's
    deeper = deepseek_v3_tensor_plan({**cfg, "num_hidden_layers": n + 1}, False)
    mtp_prefix = f"model.layers.{n}."
    specs = [_bench_tensor(s, D) for s in deeper if not s.name.startswith(mtp_prefix)]
    specs += [_bench_tensor(s, D) for s in deeper if s.name.startswith(mtp_prefix)]
    noise = float(cfg["mtp_bench_noise"]) * D ** -0.5
    specs += [TensorSpec(f"{mtp_prefix}eh_proj.weight", (D, 2 * D), std=noise, kind="identity"),
              *(TensorSpec(f"{mtp_prefix}{name}.weight", (D,), std=0.0, kind="norm")
                for name in ("enorm", "hnorm", "shared_head.norm"))]
    return specs


def _bench_tensor(spec: TensorSpec, hidden: int) -> TensorSpec:
    """One main-plan tensor as the benchmark checkpoint stores it (module docstring)."""
    name = spec.name
    if name == "model.embed_tokens.weight" or name.endswith((".mlp.gate.weight", "correction_bias")):
        return spec
    if name == "lm_head.weight":
        return TensorSpec(name, spec.shape, std=LOGIT_STD * hidden ** -0.5)
    if spec.kind == "norm":
        return TensorSpec(name, spec.shape, std=0.0, kind="norm", dtype=spec.dtype)
    return TensorSpec(name, spec.shape, kind="zeros", dtype=spec.dtype)


def _tiny() -> dict:
    return mtp_bench_config(vocab=1024, hidden=128, inter=256, moe_inter=64, layers=2, heads=4, kv_lora=64, nope=32,
                            rope=16, vdim=32, experts=8, top_k=2, shared=1, noise=0.05)


def _v2_lite_shapes(layers: int) -> dict:
    return mtp_bench_config(vocab=102400, hidden=2048, inter=10944, moe_inter=1408, layers=layers, heads=16,
                            kv_lora=512, nope=128, rope=64, vdim=128, experts=64, top_k=6, shared=2, noise=0.07)


for _preset in (
    Preset("tiny-mtp-bench", "tiny DeepSeek-V3 with an MTP module whose drafts are accepted at a set rate "
           "(presets_mtp_bench.py), fp32", _tiny(), dtype="float32", tensor_plan=mtp_bench_tensor_plan),
    Preset("v2-lite-mtp-bench", "DeepSeek-V2-Lite layer shapes (8 layers) with an MTP module accepted at a set rate "
           "(speculation benchmark, presets_mtp_bench.py), bf16, ~10 GB", _v2_lite_shapes(8),
           max_shard_bytes=2 * 1024**3, tensor_plan=mtp_bench_tensor_plan),
    Preset("v2-lite-mtp-bench-27l", "DeepSeek-V2-Lite shapes and depth (27 layers) with an MTP module accepted at a "
           "set rate (presets_mtp_bench.py), bf16, ~31 GB", _v2_lite_shapes(27), max_shard_bytes=4 * 1024**3,
           tensor_plan=mtp_bench_tensor_plan),
):
    register_preset(_preset)
del _preset
