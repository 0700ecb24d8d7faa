"""config.json of the DeepSeek V2 / V3 family, parsed once into a frozen dataclass.

Routing is derived from `model_type` plus the config, with the defaults of
Hugging Face's DeepseekV2Config / DeepseekV3Config and the rules of DeepSeek's
own modeling code: V2 routes with softmax scores (greedy or
group_limited_greedy), V3 (R1, V3.1) with sigmoid scores, an
`e_score_correction_bias` and grouped top-k (noaux_tc). A routing value the
family does not use is refused, never swapped for another router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.backend import RouterSpec
from deepinfer.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# Per model_type: the values HF's config classes default to, and the routing DeepSeek's code implements.
_FAMILY = {
    "deepseek_v2": dict(
        scoring_funcs=("softmax",),
        topk_methods=("greedy", "group_limited_greedy"),
        default_scoring="softmax",  # DeepseekV2TopkRouter always uses softmax
        default_topk_method="greedy",  # DeepseekV2Config.topk_method
        n_group=None,
        topk_group=None,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=0,
        n_shared_experts=2,
    ),
    "deepseek_v3": dict(
        scoring_funcs=("sigmoid",),
        topk_methods=("noaux_tc",),
        default_scoring="sigmoid",  # DeepseekV3TopkRouter always uses sigmoid + noaux_tc
        default_topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        n_shared_experts=1,
    ),
}

_MISSING = object()


@dataclass(frozen=True)
class DeepseekConfig:
    """Everything the V2/V3 model needs, checked and with defaults resolved."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # normalized: {"type": "yarn", "rope_type": "yarn", factor, ...} or None
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    quantization: str | None  # "fp8_block", "int4_awq" / "int4_gptq", "int8_w8a8" (msModelSlim) or None
    weight_block_size: tuple[int, int] | None
    num_nextn_predict_layers: int
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """DeepSeek's rule: routed experts from layer first_k_dense_replace on, every moe_layer_freq-th layer."""
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    def router_spec(self) -> RouterSpec:
        # DeepSeek's V2 gate normalizes top-k weights *instead of* scaling them; V3 normalizes, then scales.
        norm = self.norm_topk_prob and self.num_experts_per_tok > 1
        scale = self.routed_scaling_factor
        if self.model_type == "deepseek_v2" and norm:
            scale = 1.0
        return RouterSpec(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            scoring_func=self.scoring_func,
            topk_method=self.topk_method,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=norm,
            routed_scaling_factor=scale,
        )


# ---------------------------------------------------------------- typed getters


def _get(cfg: dict, key: str, kind: str, default: Any = _MISSING, nullable: bool = False) -> Any:
    """Read `key` as kind ("int" | "pos_int" | "nonneg_int" | "float" | "bool" | "str"); errors name the key."""
    if key not in cfg:
        if default is _MISSING:
            raise ModelLoadError(f"config.json: required key {key!r} is missing")
        return default
    value = cfg[key]
    if value is None:
        if nullable:
            return None
        if default is not _MISSING:
            return default
        raise ModelLoadError(f"config.json: key {key!r} must not be null")
    if kind in ("int", "pos_int", "nonneg_int"):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ModelLoadError(f"config.json: key {key!r} must be an integer, got {value!r}")
        if kind == "pos_int" and value <= 0:
            raise ModelLoadError(f"config.json: key {key!r} must be > 0, got {value}")
        if kind == "nonneg_int" and value < 0:
            raise ModelLoadError(f"config.json: key {key!r} must be >= 0, got {value}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"config.json: key {key!r} must be a number, got {value!r}")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ModelLoadError(f"config.json: key {key!r} must be true or false, got {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ModelLoadError(f"config.json: key {key!r} must be a string, got {value!r}")
        return value
    raise AssertionError(kind)


# ---------------------------------------------------------------- rope


def _parse_rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, normalized scaling dict or None) from either `rope_scaling` or transformers-5 `rope_parameters`."""
    theta = _get(cfg, "rope_theta", "float", default=None, nullable=True)
    scaling = None
    for key in ("rope_scaling", "rope_parameters"):
        raw = cfg.get(key)
        if raw is None:
            continue
        if not isinstance(raw, dict):
            raise ModelLoadError(f"config.json: key {key!r} must be an object, got {raw!r}")
        if theta is None and "rope_theta" in raw:
            theta = _get(raw, "rope_theta", "float")
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        if rope_type in (None, "default"):
            continue
        if rope_type != "yarn":
            raise UnsupportedModelError(
                f"config.json: {key}.rope_type {rope_type!r} is not supported (DeepSeek V2/V3 use 'yarn' or none)"
            )
        for k in ("factor", "original_max_position_embeddings"):
            if k not in raw or raw[k] is None:
                raise ModelLoadError(f"config.json: {key}.{k} is required for YaRN rope scaling")
        scaling = {k: v for k, v in raw.items() if k not in ("type", "rope_type", "rope_theta")}
        for k, v in scaling.items():
            if k == "truncate":
                continue
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ModelLoadError(f"config.json: {key}.{k} must be a number, got {v!r}")
        scaling["type"] = "yarn"
        scaling["rope_type"] = "yarn"
        break
    return (10000.0 if theta is None else float(theta)), scaling


def _parse_quant(cfg: dict) -> tuple[str | None, tuple[int, int] | None]:
    if "quantize" in cfg:  # msModelSlim W8A8 dynamic (int8 linears): checked by deepinfer/quant_config.py
        from deepinfer.quant_config import modelslim_scheme

        return modelslim_scheme(cfg), None
    q = cfg.get("quantization_config")
    if q is None:
        return None, None
    if not isinstance(q, dict):
        raise ModelLoadError(f"config.json: 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method in ("awq", "gptq"):  # int4 linears: format checked and read by deepinfer/quant_config.py + the loader
        from deepinfer.quant_config import checkpoint_scheme

        return checkpoint_scheme(cfg), None
    if method != "fp8":
        raise UnsupportedModelError(
            f"config.json: quantization_config.quant_method {method!r} is not supported (supported: 'fp8')"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(f"config.json: quantization_config.fmt {fmt!r} is not supported (supported: 'e4m3')")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise UnsupportedModelError(
            f"config.json: quantization_config.activation_scheme {act!r} is not supported (supported: 'dynamic')"
        )
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and list(block) == [128, 128]):
        raise UnsupportedModelError(
            f"config.json: quantization_config.weight_block_size {block!r} is not supported (supported: [128, 128])"
        )
    return "fp8_block", (128, 128)


# ---------------------------------------------------------------- entry point


def parse_deepseek_config(cfg: dict) -> DeepseekConfig:
    """Check a config.json dict of model_type deepseek_v2 / deepseek_v3 and resolve its defaults."""
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type not in _FAMILY:
        raise UnsupportedModelError(
            f"config.json: model_type {model_type!r} is not a DeepSeek V2/V3 model (expected one of {SUPPORTED_MODEL_TYPES})"
        )
    fam = _FAMILY[model_type]

    act = _get(cfg, "hidden_act", "str", default="silu")
    if act != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act {act!r} is not supported (DeepSeek uses 'silu')")

    hidden = _get(cfg, "hidden_size", "pos_int")
    heads = _get(cfg, "num_attention_heads", "pos_int")
    n_routed = _get(cfg, "n_routed_experts", "nonneg_int", nullable=True) or 0
    if n_routed:
        top_k = _get(cfg, "num_experts_per_tok", "pos_int")
        moe_inter = _get(cfg, "moe_intermediate_size", "pos_int")
        if top_k > n_routed:
            raise ModelLoadError(f"config.json: num_experts_per_tok={top_k} exceeds n_routed_experts={n_routed}")
    else:
        top_k = _get(cfg, "num_experts_per_tok", "nonneg_int", default=0, nullable=True) or 0
        moe_inter = _get(cfg, "moe_intermediate_size", "nonneg_int", default=0, nullable=True) or 0

    # routing: explicit values must be ones this family implements; absent ones take the family default
    scoring = _get(cfg, "scoring_func", "str", default=fam["default_scoring"])
    if scoring not in fam["scoring_funcs"]:
        raise UnsupportedModelError(
            f"config.json: scoring_func {scoring!r} is not supported for model_type {model_type!r} "
            f"(supported: {', '.join(fam['scoring_funcs'])})"
        )
    topk_method = _get(cfg, "topk_method", "str", default=fam["default_topk_method"])
    if topk_method not in fam["topk_methods"]:
        raise UnsupportedModelError(
            f"config.json: topk_method {topk_method!r} is not supported for model_type {model_type!r} "
            f"(supported: {', '.join(fam['topk_methods'])})"
        )
    n_group = _get(cfg, "n_group", "pos_int", default=fam["n_group"], nullable=True)
    topk_group = _get(cfg, "topk_group", "pos_int", default=fam["topk_group"], nullable=True)
    if topk_method == "greedy":
        n_group, topk_group = 1, 1
    elif n_routed:
        if n_group is None or topk_group is None:
            raise ModelLoadError(f"config.json: topk_method {topk_method!r} needs 'n_group' and 'topk_group'")
        if n_routed % n_group:
            raise ModelLoadError(f"config.json: n_routed_experts={n_routed} is not divisible by n_group={n_group}")
        if topk_group > n_group:
            raise ModelLoadError(f"config.json: topk_group={topk_group} exceeds n_group={n_group}")
        if topk_method == "noaux_tc" and n_routed // n_group < 2:
            raise ModelLoadError("config.json: noaux_tc needs at least 2 experts per group (n_routed_experts / n_group)")
    n_group = n_group or 1
    topk_group = topk_group or 1

    rope_theta, rope_scaling = _parse_rope(cfg)
    quantization, block = _parse_quant(cfg)
    q_lora = _get(cfg, "q_lora_rank", "pos_int", nullable=True)
    moe_freq = _get(cfg, "moe_layer_freq", "pos_int", default=1)
    nextn = _get(cfg, "num_nextn_predict_layers", "nonneg_int", default=0, nullable=True) or 0
    torch_dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if torch_dtype is not None and not isinstance(torch_dtype, str):
        raise ModelLoadError(f"config.json: key 'torch_dtype' must be a string, got {torch_dtype!r}")
    eos = cfg.get("eos_token_id")
    if eos is not None and not (
        (isinstance(eos, int) and not isinstance(eos, bool))
        or (isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos))
    ):
        raise ModelLoadError(f"config.json: key 'eos_token_id' must be an integer or a list of integers, got {eos!r}")

    n_shared_raw = cfg.get("n_shared_experts", fam["n_shared_experts"])
    n_shared = 0 if n_shared_raw is None else _get({"n_shared_experts": n_shared_raw}, "n_shared_experts", "nonneg_int")

    return DeepseekConfig(
        model_type=model_type,
        vocab_size=_get(cfg, "vocab_size", "pos_int"),
        hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size", "pos_int"),
        num_hidden_layers=_get(cfg, "num_hidden_layers", "pos_int"),
        num_attention_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=_get(cfg, "kv_lora_rank", "pos_int"),
        qk_nope_head_dim=_get(cfg, "qk_nope_head_dim", "pos_int"),
        qk_rope_head_dim=_get(cfg, "qk_rope_head_dim", "pos_int"),
        v_head_dim=_get(cfg, "v_head_dim", "pos_int"),
        n_routed_experts=n_routed,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        n_shared_experts=n_shared,
        first_k_dense_replace=_get(cfg, "first_k_dense_replace", "nonneg_int", default=fam["first_k_dense_replace"]),
        moe_layer_freq=moe_freq,
        scoring_func=scoring,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=_get(cfg, "norm_topk_prob", "bool", default=fam["norm_topk_prob"]),
        routed_scaling_factor=_get(cfg, "routed_scaling_factor", "float", default=fam["routed_scaling_factor"]),
        rms_norm_eps=_get(cfg, "rms_norm_eps", "float", default=1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        # HF's V2 always rotates interleaved pairs; V3 follows `rope_interleave` (default true)
        rope_interleave=True if model_type == "deepseek_v2" else _get(cfg, "rope_interleave", "bool", default=True),
        max_position_embeddings=_get(cfg, "max_position_embeddings", "pos_int"),
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", "bool", default=False),
        attention_bias=_get(cfg, "attention_bias", "bool", default=False),
        quantization=quantization,
        weight_block_size=block,
        num_nextn_predict_layers=nextn,
        torch_dtype=torch_dtype,
        bos_token_id=_get(cfg, "bos_token_id", "int", default=None, nullable=True),
        eos_token_id=eos,
        extra={k: v for k, v in cfg.items()},
    )
