"""Random-weight checkpoints in real DeepSeek naming, written tensor by tensor.

The safetensors files are written by a streaming writer (the format is an
8-byte header length, a JSON header of dtype / shape / byte offsets, then the
raw little-endian bytes), so a 31 GB checkpoint never sits in memory: each
tensor is drawn from its own seeded generator, written, and dropped.
fp8 weights are block-quantized the way DeepSeek's checkpoints are:
per 128x128 block, scale = amax / 448, weight = e4m3(W / scale), and
`weight_scale_inv` = scale (what the loader multiplies back).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass

import torch

FP8_MAX = 448.0
BLOCK = 128
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
}


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: how to draw it and how to store it."""

    name: str
    shape: tuple[int, ...]
    std: float = 1.0  # normal(0, std); for kind "norm": 1 + normal(0, std)
    # "normal" | "norm" | "expert_table" (V4 tid2eid: distinct ids in [0, std) per row) | "zeros" | "identity" (an
    # [out, in >= out] matrix: the identity plus normal(0, std) noise in its first out columns, zeros after them)
    kind: str = "normal"
    dtype: torch.dtype | None = None  # None: the checkpoint dtype
    fp8: bool = False  # store e4m3 + `<name without .weight>.weight_scale_inv`

    def scale_name(self) -> str:
        return self.name[: -len("weight")] + "weight_scale_inv"

    def scale_shape(self) -> tuple[int, int]:
        return (math.ceil(self.shape[0] / BLOCK), math.ceil(self.shape[1] / BLOCK))


def _generator(seed: int, name: str) -> torch.Generator:
    # one stream per tensor: the file is the same whatever the tensor order or sharding
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)


def draw(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The fp32 values of a tensor (before storage dtype / quantization); int64 for an expert table."""
    if spec.kind == "expert_table":
        rows, k = spec.shape
        return torch.rand((rows, int(spec.std)), generator=_generator(seed, spec.name)).argsort(dim=1)[:, :k]
    if spec.kind == "zeros":
        return torch.zeros(spec.shape, dtype=torch.float32)
    if spec.kind == "identity":
        out_f, in_f = spec.shape
        if in_f < out_f:
            raise ValueError(f"{spec.name}: an identity tensor needs in >= out, not {spec.shape}")
        t = torch.zeros(spec.shape, dtype=torch.float32)
        noise = torch.randn((out_f, out_f), generator=_generator(seed, spec.name), dtype=torch.float32) * spec.std
        t[:, :out_f] = torch.eye(out_f) + noise
        return t
    t = torch.randn(spec.shape, generator=_generator(seed, spec.name), dtype=torch.float32) * spec.std
    if spec.kind == "norm":
        t += 1.0
    return t


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] fp32 -> (e4m3 weight, fp32 scale [ceil(out/128), ceil(in/128)]); w ~= weight * scale per block."""
    out_f, in_f = w.shape
    ro, ri = math.ceil(out_f / BLOCK), math.ceil(in_f / BLOCK)
    padded = torch.zeros(ro * BLOCK, ri * BLOCK, dtype=torch.float32)
    padded[:out_f, :in_f] = w
    blocks = padded.view(ro, BLOCK, ri, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(ro * BLOCK, ri * BLOCK)[:out_f, :in_f].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def _stored(spec: TensorSpec, default: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    if spec.fp8:
        return [(spec.name, spec.shape, torch.float8_e4m3fn), (spec.scale_name(), spec.scale_shape(), torch.float32)]
    return [(spec.name, spec.shape, spec.dtype or default)]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def materialize(spec: TensorSpec, seed: int, default: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    w = draw(spec, seed)
    if spec.fp8:
        q, s = quantize_fp8_block(w)
        return [(spec.name, q), (spec.scale_name(), s)]
    return [(spec.name, w.to(spec.dtype or default))]


def _write_shard(path: str, specs: list[TensorSpec], seed: int, default: torch.dtype, bar=None) -> int:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        for name, shape, dtype in _stored(spec, default):
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            for name, t in materialize(spec, seed, default):
                data = t.contiguous().view(torch.uint8).numpy()
                f.write(memoryview(data))
                if bar is not None:
                    bar.update(data.nbytes)
    return offset


def _write_one(job: tuple[str, list[TensorSpec], int, torch.dtype]) -> int:
    torch.set_num_threads(1)
    return _write_shard(*job)


def _write_shards_parallel(out_dir: str, names: list[str], shards: list[list[TensorSpec]], seed: int,
                           dtype: torch.dtype, workers: int, bar) -> int:
    import multiprocessing as mp

    jobs = [(os.path.join(out_dir, f), g, seed, dtype) for f, g in zip(names, shards)]
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        total = 0
        for n in pool.imap_unordered(_write_one, jobs):
            total += n
            bar.update(n)
    return total


def write_safetensors(
    out_dir: str, specs: list[TensorSpec], seed: int, dtype: torch.dtype, max_shard_bytes: int | None = None,
    progress: bool | None = None, workers: int = 1,
) -> list[str]:
    """Write `specs` as model.safetensors, or as shards + model.safetensors.index.json. Returns file names.

    progress: a tqdm bar over bytes; None shows it only for checkpoints over 512 MiB.
    workers: shards written by this many processes at once (drawing is CPU-bound and one
    process per shard is bit-identical to one process overall: each tensor has its own stream).
    """
    shards: list[list[TensorSpec]] = [[]]
    size = grand_total = 0
    for spec in specs:
        n = sum(_nbytes(s, d) for _, s, d in _stored(spec, dtype))
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
        grand_total += n
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    from tqdm.auto import tqdm

    show = grand_total > 512 * 2**20 if progress is None else progress
    bar = tqdm(total=grand_total, desc="Writing weights", unit="B", unit_scale=True, disable=not show)
    total = 0
    weight_map: dict[str, str] = {}
    try:
        if workers > 1 and len(shards) > 1:
            total = _write_shards_parallel(out_dir, names, shards, seed, dtype, workers, bar)
        else:
            for file, group in zip(names, shards):
                bar.set_postfix_str(file)
                total += _write_shard(os.path.join(out_dir, file), group, seed, dtype, bar)
        for file, group in zip(names, shards):
            for spec in group:
                for name, _, _ in _stored(spec, dtype):
                    weight_map[name] = file
    finally:
        bar.close()
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


# ---------------------------------------------------------------- DeepSeek V2 / V3 naming


def deepseek_v3_tensor_plan(cfg: dict, fp8: bool) -> list[TensorSpec]:
    """Every tensor of a DeepSeek V2/V3 checkpoint, HF names, per-expert layout (as DeepSeek publishes them)."""
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H = cfg["num_attention_heads"]
    nope, rope, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora, q_lora = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    E, inter, moe_inter = cfg["n_routed_experts"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    n_shared = cfg.get("n_shared_experts") or 0
    first_dense, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    noaux = cfg.get("topk_method") == "noaux_tc"
    bias = bool(cfg.get("attention_bias"))

    def lin(name: str, out_f: int, in_f: int) -> TensorSpec:
        return TensorSpec(name, (out_f, in_f), std=in_f ** -0.5, fp8=fp8)

    def norm(name: str, n: int) -> TensorSpec:
        return TensorSpec(name, (n,), std=0.1, kind="norm")

    def mlp(prefix: str, i_size: int) -> list[TensorSpec]:
        return [lin(f"{prefix}.gate_proj.weight", i_size, D), lin(f"{prefix}.up_proj.weight", i_size, D),
                lin(f"{prefix}.down_proj.weight", D, i_size)]

    specs = [TensorSpec("model.embed_tokens.weight", (V, D), std=1.0)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if q_lora is None:
            specs.append(lin(f"{a}.q_proj.weight", H * (nope + rope), D))
        else:
            specs += [lin(f"{a}.q_a_proj.weight", q_lora, D), norm(f"{a}.q_a_layernorm.weight", q_lora),
                      lin(f"{a}.q_b_proj.weight", H * (nope + rope), q_lora)]
        specs += [lin(f"{a}.kv_a_proj_with_mqa.weight", kv_lora + rope, D), norm(f"{a}.kv_a_layernorm.weight", kv_lora),
                  lin(f"{a}.kv_b_proj.weight", H * (nope + vdim), kv_lora), lin(f"{a}.o_proj.weight", D, H * vdim)]
        if bias:  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj carry a bias (as in HF's modules)
            biased = ([("q_a_proj", q_lora)] if q_lora is not None else []) + [("kv_a_proj_with_mqa", kv_lora + rope),
                                                                               ("o_proj", D)]
            specs += [TensorSpec(f"{a}.{n}.bias", (size,), std=0.1) for n, size in biased]
        if E and i >= first_dense and i % freq == 0:
            specs.append(TensorSpec(f"{p}.mlp.gate.weight", (E, D), std=D ** -0.5))
            if noaux:
                specs.append(TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (E,), std=0.1, dtype=torch.float32))
            for e in range(E):
                specs += mlp(f"{p}.mlp.experts.{e}", moe_inter)
            if n_shared:
                specs += mlp(f"{p}.mlp.shared_experts", moe_inter * n_shared)
        else:
            specs += mlp(f"{p}.mlp", inter)
        specs += [norm(f"{p}.input_layernorm.weight", D), norm(f"{p}.post_attention_layernorm.weight", D)]
    specs.append(norm("model.norm.weight", D))
    if not cfg.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (V, D), std=2.0 * D ** -0.5))
    return specs
