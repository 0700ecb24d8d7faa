"""The quantization config file (`--quantization-config quant.yaml`, `EngineConfig(quantization_config=...)`)
and the checkpoint formats' quantization_config, mapped onto one `LinearQuantSettings`.

File keys (docs/quantization.md):

    method: fp8 | int4 | awq | gptq | fp4
    weight_bits: 8 for fp8, 4 for int4 / awq / gptq / fp4
    activation_bits: fp8: 8 (W8A8, the default) or 16 (W8A16); int4, fp4: 16
    group_size: fp8: 128 (128x128 weight blocks and 1x128 activation groups); fp4: 32; int4: the checkpoint's
        group of input channels (32, 64 or 128), checked against its config.json
    fuse_quant_dequant: W8A8 only: true has the op before each W8A8 linear (the RMSNorm, the SiLU-and-mul) write
        the linear's e4m3 input in its own pass (backend/fp8_act.py; a backend without it refuses at start-up),
        false quantizes in each consumer's kernel; left out: DEEPINFER_FP8_EPILOGUE_QUANT decides (default off)

An unknown key, a wrong type or an impossible combination is a ConfigError naming it. fp4 (weight_bits 4,
activation_bits 16, group_size 32) runs the routed experts of a checkpoint that stores them in fp4 (V4's), as
stored, on a backend whose MoE op lists fp4 (refused at start-up elsewhere); there is no online fp4.
`resolve_linear_quant` puts the file, the `--quantization` flag and the checkpoint's own format together: fp8
on a bf16 checkpoint quantizes it at load (online); on an fp8 checkpoint it picks W8A8 / W8A16; int4 needs an
AWQ / GPTQ checkpoint (no online int4). An msModelSlim W8A8 dynamic checkpoint (config.json `quantize:
w8a8_dynamic`) runs "int8_w8a8" as stored (no flag or file selects it; fp8 / int4 asked for on it are refused).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from deepinfer.backend import FP4_GROUP, INT4_EXPERT_GROUPS
from deepinfer.errors import ConfigError, ModelLoadError, UnsupportedModelError
from deepinfer.models.layers.quant.settings import LinearQuantSettings

FILE_KEYS = ("method", "weight_bits", "activation_bits", "group_size", "fuse_quant_dequant")
METHODS = ("fp8", "int4", "awq", "gptq", "fp4")
# int4 groups the engine reads (the dense linears and the routed experts alike): AutoAWQ / AutoGPTQ's 128 and
# the smaller powers of two some checkpoints use (e.g. 64); every backend's int4 kernel indexes groups per row
INT4_GROUPS = INT4_EXPERT_GROUPS
# method fp4: the routed experts as DeepSeek-V4 stores them (e2m1 + per-32 e8m0 scales, `expert_dtype: fp4` in
# config.json), run quantized by MoE ops that list "fp4" (BackendCaps.moe_quant_schemes); no online fp4
FP4_REASON = ("method fp4 runs routed experts stored in fp4 (DeepSeek-V4's `quantization_config.expert_dtype: "
              "fp4`); quantizing other weights to fp4 at load is not built")


@dataclass(frozen=True)
class QuantConfig:
    """A checked quantization config file."""

    method: str
    weight_bits: int
    activation_bits: int
    group_size: int | None = 128  # None (int4 only): the checkpoint's
    fuse_quant_dequant: bool | None = None  # None: not in the file (the env knob decides)
    source: str = "quantization_config"  # where it came from, for error messages

    @property
    def int4(self) -> bool:
        return self.method in ("int4", "awq", "gptq")

    @property
    def moe_scheme(self) -> str | None:
        """The routed-expert scheme the file asks the backend's MoE op to run quantized (fp4), else None."""
        return "fp4" if self.method == "fp4" else None


def _int(where: str, key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}: {key} must be an integer, got {v!r}")
    return v


def parse_quant_config(value: str | os.PathLike | dict) -> QuantConfig:
    """A YAML file path or an already-parsed mapping -> QuantConfig (ConfigError naming the key)."""
    if isinstance(value, (str, os.PathLike)):
        where = str(value)
        try:
            import yaml

            with open(value, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ConfigError(f"quantization_config: cannot read {where}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"quantization_config: {where} is not valid YAML: {exc}") from exc
    elif isinstance(value, dict):
        where, data = "quantization_config", value
    else:
        raise ConfigError(f"quantization_config must be a YAML file path or a mapping, got {type(value).__name__}")
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a mapping of keys ({', '.join(FILE_KEYS)})")
    unknown = sorted(str(k) for k in data if k not in FILE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(FILE_KEYS)})")
    method = data.get("method")
    if method not in METHODS:
        raise ConfigError(f"{where}: method must be one of {', '.join(METHODS)}, got {method!r}")
    int4 = method != "fp8"  # fp4 too: 4-bit weights, weight-only
    wb = _int(where, "weight_bits", data.get("weight_bits", 4 if int4 else 8))
    ab = _int(where, "activation_bits", data.get("activation_bits", 16 if int4 else 8))
    default_group = None if method in ("int4", "awq", "gptq") else FP4_GROUP if method == "fp4" else 128
    gs = data.get("group_size", default_group)
    gs = None if gs is None else _int(where, "group_size", gs)  # int4 without it: the checkpoint's group
    fuse = data.get("fuse_quant_dequant")  # left out: None (the env knob decides)
    if "fuse_quant_dequant" in data and not isinstance(fuse, bool):
        raise ConfigError(f"{where}: fuse_quant_dequant must be true or false, got {fuse!r}")
    if wb != (4 if int4 else 8):
        raise ConfigError(f"{where}: method {method} with weight_bits {wb}: {method} weights are "
                          f"{4 if int4 else 8}-bit")
    if int4 and ab != 16:
        what = ("fp4 experts run W4A16 (e2m1 weights dequantized to the compute dtype)" if method == "fp4"
                else "int4 is weight-only")
        raise ConfigError(f"{where}: method {method} with activation_bits {ab}: {what} (activation_bits 16)")
    if not int4 and ab not in (8, 16):
        raise ConfigError(f"{where}: method fp8 with activation_bits {ab}: 8 (W8A8) or 16 (W8A16)")
    if not int4 and gs != 128:
        raise ConfigError(f"{where}: group_size {gs}: fp8 supports only 128 (128x128 weight blocks)")
    if method == "fp4" and gs != FP4_GROUP:
        raise ConfigError(f"{where}: group_size {gs}: fp4 supports only {FP4_GROUP} (one e8m0 scale per "
                          f"{FP4_GROUP} input channels)")
    if method in ("int4", "awq", "gptq") and gs is not None and gs not in INT4_GROUPS:
        raise ConfigError(f"{where}: group_size {gs}: int4 supports {', '.join(map(str, INT4_GROUPS))}")
    if fuse and ab != 8:
        raise ConfigError(f"{where}: fuse_quant_dequant true with method {method} and activation_bits {ab}: only "
                          "fp8 W8A8 (activation_bits 8) quantizes activations, so there is no quant to fuse")
    return QuantConfig(method, wb, ab, gs, fuse, where)


# ------------------------------------------------------------------ checkpoints


@dataclass(frozen=True)
class Int4CheckpointFormat:
    method: str  # awq | gptq
    group_size: int
    zero_offset: int  # added to the stored zero point (GPTQ v1 stores z - 1)


def _qc(hf_config: dict) -> dict | None:
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelLoadError(f"config.json: 'quantization_config' must be an object, got {q!r}")
    return q


def int4_checkpoint_format(hf_config: dict) -> Int4CheckpointFormat | None:
    """The int4 format of an AWQ / GPTQ checkpoint's config.json, None for any other; refuses what it cannot read."""
    q = _qc(hf_config)
    method = None if q is None else q.get("quant_method")
    if method not in ("awq", "gptq"):
        return None
    where = f"config.json: quantization_config (quant_method {method!r})"
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if bits != 4:
        raise UnsupportedModelError(f"{where}: bits {bits!r} is not supported (supported: 4)")
    if group not in INT4_GROUPS or isinstance(group, bool):
        raise UnsupportedModelError(f"{where}: group_size {group!r} is not supported (supported: "
                                    f"{', '.join(map(str, INT4_GROUPS))})")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModelError(f"{where}: version {version!r} is not supported (supported: 'gemm', AutoAWQ's layout)")
        if q.get("zero_point", True) is not True:
            raise UnsupportedModelError(f"{where}: zero_point {q.get('zero_point')!r} is not supported (supported: true)")
        return Int4CheckpointFormat("awq", group, 0)
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"{where}: checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
    return Int4CheckpointFormat("gptq", group, 1 if fmt == "gptq" else 0)


# msModelSlim W8A8 dynamic checkpoints (what vllm-ascend / MindIE load): config.json carries
# `"quantize": "w8a8_dynamic"` and the directory a `quant_model_description.json` mapping every tensor name to
# its type ("W8A8_DYNAMIC" for an int8 linear's `.weight`, "FLOAT" for a tensor left as it was), plus
# `"model_quant_type": "W8A8_DYNAMIC"`. Each quantized linear stores `.weight` int8 [out, in], `.weight_scale`
# [out, 1] and `.weight_offset` [out, 1] (zero: symmetric per channel); activations are quantized per token.
MODELSLIM_DESCRIPTION = "quant_model_description.json"
MODELSLIM_QUANTIZE = {"w8a8_dynamic": "int8_w8a8"}
MODELSLIM_TYPES = ("W8A8_DYNAMIC", "FLOAT")
# a quantization_config written next to `quantize` may only be compressed-tensors' description of the same recipe
MODELSLIM_COMPANION_METHODS = (None, "compressed-tensors")


def modelslim_scheme(hf_config: dict) -> str | None:
    """The scheme of an msModelSlim checkpoint's config.json (`quantize`), None without that key; refuses others."""
    if "quantize" not in hf_config:
        return None
    value = hf_config["quantize"]
    if value not in MODELSLIM_QUANTIZE:
        raise UnsupportedModelError(f"config.json: quantize {value!r} is not supported (supported: "
                                    f"{', '.join(MODELSLIM_QUANTIZE)}, msModelSlim's W8A8 dynamic)")
    q = _qc(hf_config)
    if q is not None and q.get("quant_method") not in MODELSLIM_COMPANION_METHODS:
        raise ModelLoadError(f"config.json: quantize {value!r} and quantization_config.quant_method "
                             f"{q.get('quant_method')!r} disagree about how the weights are stored")
    return MODELSLIM_QUANTIZE[value]


def read_modelslim_description(path: str) -> dict[str, str]:
    """`quant_model_description.json` of a checkpoint directory: tensor name -> "W8A8_DYNAMIC" | "FLOAT", checked."""
    file = os.path.join(path, MODELSLIM_DESCRIPTION)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"config.json declares quantize w8a8_dynamic but {file} does not exist "
                             "(msModelSlim writes it beside the weights)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: must hold a JSON object of tensor name -> quant type")
    kind = data.get("model_quant_type")
    if kind != "W8A8_DYNAMIC":
        raise UnsupportedModelError(f"{file}: model_quant_type {kind!r} is not supported (supported: W8A8_DYNAMIC)")
    out = {}
    for name, t in data.items():
        if not name.endswith((".weight", ".bias", ".weight_scale", ".weight_offset")) or name.count(".") == 0:
            continue  # metadata keys (model_quant_type, version, ...), not tensors
        if t not in MODELSLIM_TYPES:
            raise UnsupportedModelError(f"{file}: {name} has quant type {t!r} (supported: {', '.join(MODELSLIM_TYPES)})")
        out[name] = t
    return out


def checkpoint_scheme(hf_config: dict) -> str | None:
    """The linear scheme the checkpoint's weights are stored in: "fp8_block", "int4_awq", "int4_gptq",
    "int8_w8a8" (msModelSlim W8A8 dynamic) or None. (fp8 checkpoints' own fields are checked by the model's
    config parser.)"""
    ms = modelslim_scheme(hf_config)
    if ms is not None:
        return ms
    q = _qc(hf_config)
    if q is None:
        return None
    fmt = int4_checkpoint_format(hf_config)
    if fmt is not None:
        return f"int4_{fmt.method}"
    if q.get("quant_method") == "fp8":
        return "fp8_block"
    raise ModelLoadError(f"config.json: quantization_config.quant_method {q.get('quant_method')!r} is not supported "
                         "(supported: fp8, awq, gptq)")


def resolve_linear_quant(quantization: str | None, quant_config: QuantConfig | None, hf_config: dict
                         ) -> tuple[LinearQuantSettings, str | None]:
    """(settings for the load, the scheme the backend must run) from the flag, the file and the checkpoint."""
    ckpt = checkpoint_scheme(hf_config)
    flag = None if quantization is None else ("fp8" if quantization in ("fp8", "fp8_block") else quantization)
    if flag not in (None, "fp8"):
        raise ConfigError(f"EngineConfig.quantization={quantization!r} is not supported (supported: fp8; int4 comes from the "
                          "checkpoint or method awq / gptq in EngineConfig.quantization_config)")
    if quant_config is not None and flag is not None and quant_config.method != flag:
        raise ConfigError(f"EngineConfig.quantization={quantization!r} and {quant_config.source}'s method "
                          f"{quant_config.method!r} disagree")
    method = quant_config.method if quant_config is not None else flag
    if method is None:
        return LinearQuantSettings(), ckpt
    if method == "fp4":  # the experts as stored; the other linears as the checkpoint stores them
        if (_qc(hf_config) or {}).get("expert_dtype") != "fp4":
            raise ConfigError(f"{quant_config.source}: {FP4_REASON}; this checkpoint's routed experts are "
                              f"{'not quantized' if ckpt is None else ckpt}")
        return LinearQuantSettings(), ckpt
    if method == "fp8":
        w8a8 = quant_config is None or quant_config.activation_bits == 8
        fuse = None if quant_config is None else quant_config.fuse_quant_dequant  # None: the env knob decides
        if ckpt is None:
            if not w8a8:
                raise ConfigError("EngineConfig.quantization_config: activation_bits 16 on a bf16 checkpoint: online fp8 "
                                  "quantization runs W8A8 (activation_bits 8)")
            return LinearQuantSettings(online="fp8", fuse_act_quant=fuse), "fp8_w8a8"
        if ckpt != "fp8_block":
            raise ConfigError(f"EngineConfig.quantization: fp8 asked for, but the checkpoint is {ckpt} (re-quantizing int4 "
                              "weights to fp8 is not supported)")
        return LinearQuantSettings(fp8_activations=w8a8, fuse_act_quant=fuse if w8a8 else None), \
            "fp8_w8a8" if w8a8 else "fp8_block"
    want = {"int4": ("int4_awq", "int4_gptq"), "awq": ("int4_awq",), "gptq": ("int4_gptq",)}[method]  # int8: no flag
    if ckpt not in want:
        raise ConfigError(f"EngineConfig.quantization_config: method {method}, but the checkpoint is "
                          f"{ckpt or 'not quantized'}; int4 needs an AWQ / GPTQ checkpoint (no online int4)")
    ckpt_group = int4_checkpoint_format(hf_config).group_size
    if quant_config.group_size is not None and quant_config.group_size != ckpt_group:
        raise ConfigError(f"{quant_config.source}: group_size {quant_config.group_size}, but the checkpoint's "
                          f"quantization_config has group_size {ckpt_group}")
    return LinearQuantSettings(), ckpt
