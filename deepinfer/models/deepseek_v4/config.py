"""DeepSeek-V4 config.json -> a typed config.

Follows the field semantics of Hugging Face transformers' DeepseekV4Config
(>= 5.24) so a checkpoint means the same thing here as in the reference:
layer schedule from `compress_ratios` (entries past num_hidden_layers belong
to MTP) or `layer_types`, MoE schedule from `mlp_layer_types` /
`num_hash_layers`, nested `rope_parameters` {"main", "compress"} with YaRN
on the compressed branches only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from deepinfer.errors import ModelLoadError, UnsupportedModelError

SWA = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SWA, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")

_DEFAULT_RATES = {CSA: 4, HCA: 128}
_DEFAULT_NUM_HASH_LAYERS = 3
_DEFAULT_PARTIAL_ROTARY = 64 / 512


@dataclass(frozen=True)
class RopeBranch:
    """One rotary branch ("main" or "compress")."""

    theta: float
    rope_dim: int  # rotated trailing channels of a head
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # cos/sin magnitude; V4 forces 1.0 on YaRN branches


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict
    mlp_layer_types: tuple[str, ...]
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    rope_main: RopeBranch
    rope_compress: RopeBranch
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    quantization: str | None = None  # None | "fp8_block"
    expert_dtype: str | None = None  # None: routed experts as the linears; "fp4": e2m1 + per-32 scales
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def compress_rate(self, layer: int) -> int:
        """m of a layer: 0 for sliding-window-only layers."""
        t = self.layer_types[layer]
        return 0 if t == SWA else int(self.compress_rates[t])

    def rope_for(self, layer: int) -> RopeBranch:
        return self.rope_main if self.layer_types[layer] == SWA else self.rope_compress

    def layers_of(self, layer_type: str) -> tuple[int, ...]:
        """The main layers of a type (not the MTP layers)."""
        return tuple(i for i, t in enumerate(self.layer_types[: self.num_hidden_layers]) if t == layer_type)

    def with_mtp_layers(self) -> DeepseekV4Config:
        """This config with the MTP layers' schedule appended (layer id num_hidden_layers + J: its attention type
        from `mtp_layer_types`, a plain top-k MoE), for building an MTP module's block; num_hidden_layers and
        `layers_of` keep meaning the main layers."""
        n = len(self.mtp_layer_types)
        return replace(self, layer_types=self.layer_types + self.mtp_layer_types,
                       mlp_layer_types=self.mlp_layer_types + ("moe",) * n)


def _req(hf: dict, key: str):
    if key not in hf or hf[key] is None:
        raise ModelLoadError(f"deepseek_v4 config.json lacks required field {key!r}")
    return hf[key]


def _rates(hf: dict) -> dict:
    rates = dict(hf.get("compress_rates") or _DEFAULT_RATES)
    if hf.get("compress_rate_csa") is not None:
        rates[CSA] = int(hf["compress_rate_csa"])
    if hf.get("compress_rate_hca") is not None:
        rates[HCA] = int(hf["compress_rate_hca"])
    for t in (CSA, HCA):
        if t not in rates or int(rates[t]) <= 0:
            raise ModelLoadError(f"compress_rates[{t!r}] must be a positive integer, got {rates.get(t)!r}")
        rates[t] = int(rates[t])
    if rates[CSA] == rates[HCA]:
        raise UnsupportedModelError(f"CSA and HCA compress rates are both {rates[CSA]}; they must differ")
    return rates


def _ratio_to_type(r: int, rates: dict, where: str) -> str:
    table = {0: SWA, rates[CSA]: CSA, rates[HCA]: HCA}
    if r not in table:
        raise UnsupportedModelError(
            f"{where}: compress ratio {r} is none of 0 (sliding), {rates[CSA]} (CSA), {rates[HCA]} (HCA)"
        )
    return table[r]


def _layer_schedule(hf: dict, n: int, rates: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(main layer types, MTP layer types)."""
    ratios = hf.get("compress_ratios")
    explicit = hf.get("layer_types")
    mtp: tuple[str, ...] = ()
    if ratios is not None:
        if len(ratios) < n:
            raise ModelLoadError(f"compress_ratios has {len(ratios)} entries for num_hidden_layers={n}")
        types = [_ratio_to_type(int(r), rates, "compress_ratios") for r in ratios]
        main, mtp = tuple(types[:n]), tuple(types[n:])
        if explicit is not None and tuple(explicit[:n]) != main:
            raise ModelLoadError(f"compress_ratios {list(ratios)} disagree with layer_types {list(explicit)}")
    elif explicit is not None:
        main = tuple(explicit[:n])
        if len(main) != n:
            raise ModelLoadError(f"layer_types has {len(explicit)} entries for num_hidden_layers={n}")
    else:  # the reference's default: 2 HCA layers, then CSA / HCA interleaved
        main = tuple([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])
    bad = [t for t in main + mtp if t not in LAYER_TYPES]
    if bad:
        raise UnsupportedModelError(f"unknown deepseek_v4 layer types {bad}; expected one of {LAYER_TYPES}")
    return main, mtp


def _mlp_schedule(hf: dict, n: int) -> tuple[str, ...]:
    types = hf.get("mlp_layer_types")
    if types is None:
        n_hash = hf.get("num_hash_layers")
        n_hash = _DEFAULT_NUM_HASH_LAYERS if n_hash is None else int(n_hash)
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    types = tuple(types[:n])
    if len(types) != n:
        raise ModelLoadError(f"mlp_layer_types has {len(types)} entries for num_hidden_layers={n}")
    bad = [t for t in types if t not in MLP_TYPES]
    if bad:
        raise UnsupportedModelError(f"unknown deepseek_v4 mlp_layer_types {bad}; expected one of {MLP_TYPES}")
    return types


def _branch(d: dict, head_dim: int, default_prf: float, name: str) -> RopeBranch:
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_parameters[{name!r}] rope_type {rope_type!r} is not one of {ROPE_TYPES}")
    if "rope_theta" not in d:
        raise ModelLoadError(f"rope_parameters[{name!r}] lacks rope_theta")
    prf = d.get("partial_rotary_factor", default_prf)
    rope_dim = int(head_dim * prf)
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ModelLoadError(f"rope_parameters[{name!r}]: rotary dim {rope_dim} must be even and in (0, {head_dim}]")
    if rope_type == "default":
        return RopeBranch(theta=float(d["rope_theta"]), rope_dim=rope_dim)
    for k in ("factor", "original_max_position_embeddings"):
        if d.get(k) is None:
            raise ModelLoadError(f"rope_parameters[{name!r}] is YaRN but lacks {k!r}")
    factor = float(d["factor"])
    att = d.get("attention_factor")
    if att is None:  # the reference's derivation when no explicit factor is given
        import math

        def mscale(s: float, m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        ms, ms_all = d.get("mscale"), d.get("mscale_all_dim")
        att = mscale(factor, ms) / mscale(factor, ms_all) if (ms and ms_all) else mscale(factor)
    return RopeBranch(
        theta=float(d["rope_theta"]),
        rope_dim=rope_dim,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        beta_fast=float(d.get("beta_fast") or 32),
        beta_slow=float(d.get("beta_slow") or 1),
        attention_factor=float(att),
    )


def _rope(hf: dict, head_dim: int, prf: float) -> tuple[RopeBranch, RopeBranch]:
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        # nested form: a branch without partial_rotary_factor rotates the whole head, as in the reference
        return _branch(rp["main"], head_dim, 1.0, "main"), _branch(rp["compress"], head_dim, 1.0, "compress")
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    theta = float(hf.get("rope_theta", 10000.0))
    main = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": prf}
    compress = {**flat, "rope_theta": float(hf.get("compress_rope_theta", 160000.0)), "partial_rotary_factor": prf}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin on YaRN branches
    return _branch(main, head_dim, prf, "main"), _branch(compress, head_dim, prf, "compress")


def _quantization(hf: dict) -> str | None:
    q = hf.get("quantization_config")
    if not q:
        return None
    if q.get("expert_dtype") not in (None, "fp8", "bf16", "bfloat16", "fp4"):
        raise UnsupportedModelError(f"deepseek_v4 expert_dtype {q.get('expert_dtype')!r} is not supported "
                                    "(fp8 / bf16 / fp4)")
    method, block = q.get("quant_method"), q.get("weight_block_size")
    if method == "fp8" and list(block or []) == [128, 128]:
        return "fp8_block"
    raise UnsupportedModelError(f"deepseek_v4 quantization_config {q!r} is not supported (fp8 128x128 blocks only)")


def parse_v4_config(hf: dict) -> DeepseekV4Config:
    """Validate and normalise a deepseek_v4 config.json dict; errors name the field."""
    if hf.get("model_type") != "deepseek_v4":
        raise UnsupportedModelError(f"expected model_type 'deepseek_v4', got {hf.get('model_type')!r}")
    n = int(_req(hf, "num_hidden_layers"))
    head_dim = int(hf.get("head_dim", 512))
    if hf.get("num_key_value_heads", 1) != 1:
        raise UnsupportedModelError("deepseek_v4 uses shared-KV MQA: num_key_value_heads must be 1")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"deepseek_v4 hidden_act {hf.get('hidden_act')!r} is not supported (silu only)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UnsupportedModelError("deepseek_v4 with attention_bias / mlp_bias is not supported")
    if int(hf.get("n_shared_experts", 1)) != 1:
        raise UnsupportedModelError(f"deepseek_v4 n_shared_experts={hf.get('n_shared_experts')} (only 1 is defined)")
    scoring = hf.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise UnsupportedModelError(f"deepseek_v4 scoring_func {scoring!r} is not one of {SCORING_FUNCS}")
    prf = hf.get("partial_rotary_factor")
    if prf is None:
        prf = hf["qk_rope_head_dim"] / head_dim if hf.get("qk_rope_head_dim") else _DEFAULT_PARTIAL_ROTARY
    rates = _rates(hf)
    layer_types, mtp_types = _layer_schedule(hf, n, rates)
    rope_main, rope_compress = _rope(hf, head_dim, float(prf))
    heads, groups = int(hf.get("num_attention_heads", 64)), int(hf.get("o_groups", 8))
    if heads % groups:
        raise ModelLoadError(f"num_attention_heads={heads} is not divisible by o_groups={groups}")
    window = int(hf.get("sliding_window", 128))
    if window < 1:
        raise ModelLoadError(f"sliding_window must be >= 1, got {window}")
    return DeepseekV4Config(
        vocab_size=int(_req(hf, "vocab_size")),
        hidden_size=int(_req(hf, "hidden_size")),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=int(hf.get("q_lora_rank", 1024)),
        o_groups=groups,
        o_lora_rank=int(hf.get("o_lora_rank", 1024)),
        sliding_window=window,
        layer_types=layer_types,
        compress_rates=rates,
        mlp_layer_types=_mlp_schedule(hf, n),
        moe_intermediate_size=int(_req(hf, "moe_intermediate_size")),
        n_routed_experts=int(hf.get("n_routed_experts", 256)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 6)),
        scoring_func=scoring,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
        hc_mult=int(hf.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(hf.get("hc_eps", 1e-6)),
        index_n_heads=int(hf.get("index_n_heads", 64)),
        index_head_dim=int(hf.get("index_head_dim", 128)),
        index_topk=int(hf.get("index_topk", 512)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_main=rope_main,
        rope_compress=rope_compress,
        max_position_embeddings=int(hf.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers", 0) or 0),
        mtp_layer_types=mtp_types,
        quantization=_quantization(hf),
        expert_dtype="fp4" if (hf.get("quantization_config") or {}).get("expert_dtype") == "fp4" else None,
        raw=dict(hf),
    )
