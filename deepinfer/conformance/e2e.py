"""End-to-end rows: a tiny random-weight model run through the backend vs through NativeOps.

Each preset (V2 / V3, and tiny-v4 on backends whose caps take deepseek_v4;
written with deepinfer.checkpoints) is loaded twice on
the backend's device: once with the backend's ops, once with a NativeOps
reference backend. Two requests of different lengths are prefilled in one
batch (the longer one in two chunks, so the second chunk attends to a cached
prefix), then decoded for a few steps, teacher-forced with the reference's
argmax. Every step's logits are compared with the model tolerance, and the
backend's argmax must be within that tolerance of the reference maximum.

These rows run in fp32 only: in bf16 / fp16 a near-tie in expert selection
can legitimately flip a token's routing between two correct implementations,
and one flip moves the logits far outside any sane tolerance, so a
low-precision whole-model row could fail without a bug. The op rows cover
the low-precision kernels.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from deepinfer.backend import Backend, BackendCaps, FeatureRequest, ForwardBatch, KVCaches, NativeOps, token_slots
from deepinfer.conformance.report import ConformanceReport, ConformanceRow
from deepinfer.errors import UnsupportedOpError

E2E_PRESETS = ("tiny-v2-lite", "tiny-v2", "tiny-v3", "tiny-v3-fp8", "tiny-v4")
# (long, short) prompt lengths; tiny-v4's pass its window (W=8) and both compress rates (4, 16),
# so the second chunk reads window keys, compressed entries and a compressor ring from the cache
PROMPT_LENS = {"tiny-v4": (40, 21)}
DEFAULT_PROMPT_LENS = (13, 6)
MODEL_DTYPE = torch.float32
MODEL_TOLERANCE = (2e-3, 2e-3)  # (atol, rtol) on the logits of a whole (3-layer) tiny model
DECODE_STEPS = 3


class ReferenceBackend(NativeOps, Backend):
    """NativeOps on a given device: the oracle for a whole model."""

    name = "native-reference"

    def __init__(self, device: torch.device):
        self._device = torch.device(device)

    @property
    def caps(self) -> BackendCaps:
        return BackendCaps(device_type=self._device.type, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                           quant_schemes=("none", "fp8_block"))

    @property
    def device(self) -> torch.device:
        return self._device


def _batch(chunks: list[tuple[list[int], int]], tables: list[list[int]], specs: list, block_size: int,
           device: torch.device) -> ForwardBatch:
    """chunks[i] = (token ids scheduled now, context_len) for request i, on block row tables[i] (every
    group uses the same rows; each group's slots follow its tokens_per_entry, as token_slots defines)."""
    ids, pos, qsl = [], [], [0]
    for tokens, ctx in chunks:
        for j, tok in enumerate(tokens):
            ids.append(tok)
            pos.append(ctx + j)
        qsl.append(qsl[-1] + len(tokens))
    qlens = [len(t) for t, _ in chunks]
    ctxs = [c for _, c in chunks]
    seqs = [q + c for q, c in zip(qlens, ctxs)]
    width = max(len(r) for r in tables)
    bt = torch.tensor([r + [-1] * (width - len(r)) for r in tables], dtype=torch.int32, device=device)
    positions = torch.tensor(pos, dtype=torch.long, device=device)
    req_idx = torch.repeat_interleave(torch.arange(len(chunks), device=device), torch.tensor(qlens, device=device))
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=positions,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seqs, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctxs, dtype=torch.int32, device=device),
        block_tables={s.name: bt for s in specs},
        slot_mapping={s.name: token_slots(bt, req_idx, positions, s.tokens_per_entry, block_size) for s in specs},
        logits_indices=torch.tensor(qsl[1:], dtype=torch.long, device=device) - 1,
        query_lens_cpu=qlens, seq_lens_cpu=seqs, context_lens_cpu=ctxs, block_size=block_size,
        # request i keeps state row i (V4 compressor rings); fresh rows are zero from allocation
        state_slots=torch.arange(len(chunks), dtype=torch.int32, device=device),
        state_slots_cpu=list(range(len(chunks))),
    )


def _teacher_forced_logits(model, ref_model, backend: Backend, prompts: list[list[int]]) -> tuple[list, list]:
    """Logits [2, V] per step from both models, the reference's argmax fed back to both."""
    device = backend.device
    block_size = backend.caps.kv_block_sizes[0]
    specs = model.kv_cache_specs()
    groups = [s.name for s in specs]
    max_len = max(len(p) for p in prompts) + DECODE_STEPS + 1
    per_req = -(-max_len // block_size)
    nblocks = per_req * len(prompts) + 1
    # interleaved, out-of-order blocks so paging is exercised
    tables = [[nblocks - 1 - (2 * b + i) for b in range(per_req)] for i in range(len(prompts))]
    caches = [KVCaches.allocate(specs, {g: nblocks for g in groups}, block_size, len(prompts), device)
              for _ in range(2)]
    long, short = prompts
    cut = len(long) // 2
    seqs = [list(long), list(short)]
    outs: list[torch.Tensor] = []
    refs: list[torch.Tensor] = []
    last_ref: list[torch.Tensor | None] = [None, None]

    def step(chunks, rows_done: list[int]) -> None:
        """Run one batch on both models; keep the logits of the requests whose prompt is complete."""
        batch = _batch(chunks, tables[: len(chunks)], specs, block_size, device)
        out = model.compute_logits(model.forward(batch, caches[0])[batch.logits_indices]).float()
        ref = ref_model.compute_logits(ref_model.forward(batch, caches[1])[batch.logits_indices]).float()
        for r in rows_done:
            outs.append(out[r : r + 1])
            refs.append(ref[r : r + 1])
            last_ref[r] = ref[r]

    step([(long[:cut], 0), (short, 0)], rows_done=[1])  # long prompt: first chunk; short prompt: whole
    step([(long[cut:], cut)], rows_done=[0])  # second chunk on the cached prefix
    for _ in range(DECODE_STEPS):  # teacher-forced decode of both requests in one batch
        chunks = []
        for r in range(2):
            tok = int(last_ref[r].argmax())
            chunks.append(([tok], len(seqs[r])))
            seqs[r].append(tok)
        step(chunks, rows_done=[0, 1])
    return outs, refs


def _compare(outs: list, refs: list) -> tuple[bool, float, float, float, float, str]:
    atol, rtol = MODEL_TOLERANCE
    max_abs, ratio, bad_argmax = 0.0, 0.0, 0
    for o, r in zip(outs, refs):
        diff = (o - r).abs()
        max_abs = max(max_abs, float(diff.max()))
        ratio = max(ratio, float((diff / (atol + rtol * r.abs())).max()))
        picked = r.gather(1, o.argmax(-1, keepdim=True)).squeeze(1)
        bad_argmax += int((r.max(-1).values - picked > atol + rtol * r.abs().max(-1).values).sum())
    if not all(torch.isfinite(o).all() for o in outs):
        return False, float("inf"), float("inf"), atol, rtol, "non-finite logits"
    passed = ratio <= 1.0 and bad_argmax == 0
    reason = "" if passed else f"max error {ratio:.3g}x the tolerance; {bad_argmax} argmax outside tolerance"
    return passed, max_abs, ratio, atol, rtol, reason


def run_model_rows(
    backend: Backend, report: ConformanceReport, seed: int, presets: tuple[str, ...] = E2E_PRESETS
) -> None:
    """Append one fp32 "model" row per preset to `report`."""
    from deepinfer.checkpoints import make_checkpoint
    from deepinfer.models.registry import load_hf_config, load_model

    reference = ReferenceBackend(backend.device)
    with tempfile.TemporaryDirectory(prefix="deepinfer-conformance-") as tmp:
        for preset in presets:
            path = os.path.join(tmp, preset)
            make_checkpoint(preset, path, seed=seed, progress=False)
            hf = load_hf_config(path)
            row = ConformanceRow(op="model", case=f"{preset} prefill(chunked)+{DECODE_STEPS} decode",
                                 dtype=str(MODEL_DTYPE).removeprefix("torch."), status="pass", impl="whole model")
            report.rows.append(row)
            quant = "fp8_block" if hf.get("quantization_config") else None
            reasons = backend.caps.unsupported(
                FeatureRequest(dtype=MODEL_DTYPE, quantization=quant, model_type=hf.get("model_type"))
            )
            if reasons:
                row.status, row.reason = "unsupported", "; ".join(reasons)
                continue
            gen = torch.Generator().manual_seed(seed)
            lens = PROMPT_LENS.get(preset, DEFAULT_PROMPT_LENS)
            prompts = [torch.randint(2, int(hf["vocab_size"]), (n,), generator=gen).tolist() for n in lens]
            start = time.perf_counter()
            try:
                model = load_model(path, backend, MODEL_DTYPE, progress=False, hf_config=hf)
                ref_model = load_model(path, reference, MODEL_DTYPE, progress=False, hf_config=hf)
                with torch.inference_mode():
                    outs, refs = _teacher_forced_logits(model, ref_model, backend, prompts)
                backend.synchronize()
            except (UnsupportedOpError, NotImplementedError) as exc:
                row.status, row.reason = "unsupported", f"{type(exc).__name__}: {exc}"
                continue
            except Exception as exc:  # reported, the suite goes on
                row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"
                continue
            finally:
                row.seconds = time.perf_counter() - start
            passed, row.max_abs_err, row.err_ratio, row.atol, row.rtol, row.reason = _compare(outs, refs)
            row.status = "pass" if passed else "fail"
