"""The ops matrix: every backend's answer to "can you run this op spec, and with what?".

Rows are representative op specs (every op of the contract; the variants a backend may treat
differently: each router, MoE with V3 and V4 routers, V4 attention kinds, the clamped SwiGLU; the
sampler's grammar bitmask);
columns are backends; a cell is what `Backend.op_impl` names where `Backend.supports` has no
reasons, or the reasons, per dtype. `deepinfer check --list-ops --format md` renders it, and
docs/ops.md is that output for the cpu and nvidia backends (a test keeps it current), like
ggml's test-backend-ops coverage table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from deepinfer.backend import OP_NAMES, Backend, MLASpec, MoESpec, OpSpec, V4AttentionSpec, dtype_name
from deepinfer.conformance.cases_base import router_specs

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MatrixRow:
    op: str
    variant: str  # what distinguishes this row, e.g. "v3 sigmoid noaux_tc"
    spec: object = None
    options: tuple = ()

    def op_spec(self, dtype: torch.dtype) -> OpSpec:
        return OpSpec(self.op, dtype, self.spec, self.options)


def matrix_rows() -> list[MatrixRow]:
    """Representative specs at DeepSeek's real widths (V2-Lite / V3 / V4-Flash), every op covered."""
    v3_mla = MLASpec(num_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                     softmax_scale=192**-0.5)
    routers = router_specs(real=True)
    v4_router = routers["v4 sqrtsoftplus noaux_tc"]
    v4_hash = routers["v4 sqrtsoftplus hash"]
    v4 = dict(num_heads=64, head_dim=512, sliding_window=128, softmax_scale=512**-0.5, swa_group="v4_swa")
    rows = [
        MatrixRow("rms_norm", "D=7168"),
        MatrixRow("add_rms_norm", "D=7168"),
        MatrixRow("rotary_embedding", "R=64"),
        MatrixRow("silu_and_mul", "plain"),
        MatrixRow("silu_and_mul", "clamped (V4 swiglu_limit)", options=(("limit", 10.0),)),
        MatrixRow("kv_cache_write", "entry 576"),
        *(MatrixRow("route", name, spec) for name, spec in routers.items()),
        MatrixRow("rms_norm_fp8", "D=7168, + e4m3 per token per 128 (fp8 W8A8 consumers)"),
        MatrixRow("silu_and_mul_fp8", "plain, + e4m3 per token per 128 (a W8A8 down projection)"),
        MatrixRow("v4_rms_norm", "fp32 weight / unweighted"),
        MatrixRow("v4_rotary_embedding", "trailing 64 channels"),
        MatrixRow("linear:none", "dense"),
        MatrixRow("linear:fp8_block", "e4m3, 128x128 block scales"),
        MatrixRow("linear:fp8_w8a8", "e4m3 128x128 weights, activations per token per 128"),
        MatrixRow("linear:int4_awq", "AWQ int4, group 128"),
        MatrixRow("linear:int4_gptq", "GPTQ int4, group 128, g_idx"),
        MatrixRow("linear:int8_w8a8", "int8 per-channel weights, activations int8 per token (msModelSlim W8A8_DYNAMIC)"),
        MatrixRow("mla_attention", "V3 (128 heads, L=512, R=64)", v3_mla),
        *(MatrixRow("moe", f"{name} (V3 widths)", MoESpec(routers[name], 7168, 2048))
          for name in ("v2-lite softmax greedy", "v3 sigmoid noaux_tc")),
        MatrixRow("moe", "v4 sqrtsoftplus noaux_tc + swiglu_limit", MoESpec(v4_router, 4096, 2048, swiglu_limit=10.0)),
        MatrixRow("moe", "v4 hash + swiglu_limit", MoESpec(v4_hash, 4096, 2048, swiglu_limit=10.0)),
        MatrixRow("v4_attention", "sliding window only", V4AttentionSpec(**v4)),
        MatrixRow("v4_attention", "CSA (m=4, indexer top-512)",
                  V4AttentionSpec(**v4, compress_rate=4, overlap=True, comp_group="v4_csa", index_group="v4_idx",
                                  index_n_heads=64, index_head_dim=128, index_topk=512)),
        MatrixRow("v4_attention", "HCA (m=128)", V4AttentionSpec(**v4, compress_rate=128, comp_group="v4_hca")),
        MatrixRow("apply_token_bitmask", "grammar mask (int32 words) on a subset of the logit rows"),
        MatrixRow("decode_rows_meta", "one-token decode rows' tables, slots and lengths (MTP graphs)"),
        MatrixRow("draft_pick", "a draft and its confidence from the drafter's logits (MTP graphs)"),
        *(MatrixRow(name, "one process") for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                       "broadcast")),
    ]
    missing = set(OP_NAMES) - {r.op for r in rows}
    if missing:  # a new op of the contract needs a row here
        raise AssertionError(f"the ops matrix has no row for {sorted(missing)}")
    return rows


@dataclass
class Column:
    backend: str
    available: bool
    note: str = ""  # why unavailable, or the stand-in it runs on
    cells: list[str] = field(default_factory=list)


def cell(backend: Backend, row: MatrixRow) -> str:
    """The implementation where every dtype is supported; per dtype otherwise; reasons for the rest."""
    impls: dict[str, list[str]] = {}
    missing: list[str] = []
    for dt in DTYPES:
        reasons = backend.supports(row.op_spec(dt))
        if reasons:
            missing.append(f"{dtype_name(dt)}: {'; '.join(reasons)}")
        else:
            impls.setdefault(backend.op_impl(row.op_spec(dt)), []).append(dtype_name(dt))
    parts = [impl if len(dts) == len(DTYPES) else f"{impl} ({', '.join(dts)})" for impl, dts in impls.items()]
    parts += [f"✗ {m}" for m in missing]
    return "; ".join(parts)


def build_matrix(names: list[str] | None = None, registry=None) -> tuple[list[MatrixRow], list[Column]]:
    """Columns for `names` (default: every registered backend), each constructed as `--device NAME` would
    construct it (so a backend that runs emulated when named, like nvidia under TRITON_INTERPRET=1, is
    listed from its emulation); a backend that cannot be constructed here gets an empty column saying why."""
    from deepinfer.backend.registry import default_registry
    from deepinfer.errors import BackendError

    registry = registry or default_registry()
    rows = matrix_rows()
    columns = []
    for name in names or registry.names():
        try:
            backend = registry.create(name)
        except BackendError as exc:
            columns.append(Column(name, False, str(exc).splitlines()[0]))
            continue
        columns.append(Column(name, True, "", [cell(backend, r) for r in rows]))
    return rows, columns


def render_markdown(rows: list[MatrixRow], columns: list[Column]) -> str:
    head = ["| op | variant | " + " | ".join(c.backend for c in columns) + " |",
            "|---|---|" + "---|" * len(columns)]
    body = []
    for i, r in enumerate(rows):
        cells = [c.cells[i] if c.available else "—" for c in columns]
        body.append(f"| `{r.op}` | {r.variant} | " + " | ".join(x.replace("|", "/") for x in cells) + " |")
    notes = [f"- `{c.backend}`: not constructed here: {c.note}" for c in columns if not c.available]
    text = [
        "# Ops matrix",
        "",
        "Generated by `deepinfer check --list-ops --format md` (for this file: "
        "`PYTHONPATH=tests/ascend/fake_torch_npu TRITON_INTERPRET=1 deepinfer check --list-ops --format md "
        "--backends cpu,nvidia,ascend > docs/ops.md`; "
        "tests/ops/test_ops_matrix.py checks it is current). Each cell is what `Backend.op_impl` names for "
        "the op spec when `Backend.supports` finds no reason against it, for bf16, fp16 and fp32 "
        "activations alike unless dtypes are listed; `✗` gives the reasons a dtype is refused. "
        "`native` means the torch-native reference op (deepinfer/backend/native) runs. The nvidia column "
        "is the same on a GPU and under the Triton interpreter, and the ascend column the same on an NPU and "
        "over the test-only torch_npu fake (their answers depend on the specs, not the device; the ascend "
        "backend has never run on an NPU, docs/ascend.md).",
        "",
        *head,
        *body,
    ]
    if notes:
        text += ["", *notes]
    return "\n".join(text) + "\n"


def render_text(rows: list[MatrixRow], columns: list[Column]) -> str:
    out = []
    for c in columns:
        out.append(f"{c.backend}: " + ("available" if c.available else f"not constructed here: {c.note}"))
        if c.available:
            out += [f"  {r.op:<22} {r.variant:<42} {x}" for r, x in zip(rows, c.cells)]
    return "\n".join(out) + "\n"


def render_json(rows: list[MatrixRow], columns: list[Column]) -> str:
    return json.dumps([{"backend": c.backend, "available": c.available, "note": c.note,
                        "ops": [{"op": r.op, "variant": r.variant, "support": x} for r, x in zip(rows, c.cells)]}
                       for c in columns], indent=2) + "\n"


RENDERERS = {"md": render_markdown, "text": render_text, "json": render_json}
