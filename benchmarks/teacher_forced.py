"""Paired, teacher-forced logits of one token stream through DeepInfer's model, for accuracy measurements.

Why paired: two greedy runs that decode independently part ways after their first near-tie, and from then on
each is scored on a different context, so two runs' gap statistics differ by more than the implementations do
(benchmarks/accuracy_bf16.py's first measure: 896 tokens still left DeepInfer and transformers one standard
error apart). Here every implementation reads the SAME token stream (the fp32 reference's greedy tokens), and
its logits at each position are compared with the fp32 reference's at that position, so per-position errors
can be differenced between implementations.

DeepInfer's logits come from its model and KV caches inside an idle engine (prefix caching off), in one of two
forms of the same computation:
- "prefill": the whole stream as one prompt (the prefill attention path);
- "decode": the stream as one decode row per token (worker/decode_rows.decode_shaped): every token through the
  absorbed decode attention kernels, as greedy decoding computes it (the rows write their KV before any row
  attends, so row j sees exactly positions <= j).
The stream's KV is written into blocks 0.. of the engine's pool, which an idle engine does not use.
"""

from __future__ import annotations

import torch


def _decode_shaped(batch):
    try:  # moved to the worker room; older trees keep it in spec/
        from deepinfer.worker.decode_rows import decode_shaped
    except ImportError:
        from deepinfer.spec.verify_batch import decode_shaped
    return decode_shaped(batch)


@torch.inference_mode()
def deepinfer_logits(engine, ids: list[int], first: int, form: str) -> torch.Tensor:
    """fp32 logits [len(ids) - first, V] of rows first .. len(ids) - 1 (row r predicts ids[r + 1])."""
    from deepinfer.backend import ForwardBatch, token_slots

    if form not in ("prefill", "decode"):
        raise ValueError(f"form must be 'prefill' or 'decode', not {form!r}")
    runner, kv = engine.runner, engine.kv
    dev = runner.device
    t = len(ids)
    bs = kv.block_size
    nb = -(-t // bs)
    tables, slots = {}, {}
    positions = torch.arange(t, dtype=torch.int64)
    for spec in kv.specs:
        if spec.tokens_per_entry != 1 or spec.sliding_window is not None or spec.state_shape:
            raise SystemExit(f"teacher forcing covers full-attention KV groups only (group {spec.name!r})")
        table = torch.arange(nb, dtype=torch.int32).unsqueeze(0)
        tables[spec.name] = table.to(dev)
        slots[spec.name] = token_slots(table, torch.zeros(t, dtype=torch.int64), positions, 1, bs).to(dev)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=dev), positions=positions.to(dev),
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
        context_lens=torch.tensor([0], dtype=torch.int32, device=dev),
        block_tables=tables, slot_mapping=slots,
        logits_indices=torch.arange(first, t, dtype=torch.int64, device=dev),
        query_lens_cpu=[t], seq_lens_cpu=[t], context_lens_cpu=[0], block_size=bs)
    if form == "decode":
        batch = _decode_shaped(batch)
    hidden = runner.model.forward(batch, runner.caches)
    return runner.model.compute_logits(hidden[batch.logits_indices]).float()[:, : runner.model.vocab_size]


def position_errors(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row, against the fp32 reference rows `ref`: whether the argmax agrees, the gap of this argmax below
    the reference's row maximum and the RMS logit error (both in reference row standard deviations), and
    KL(reference || this)."""
    ref = ref.float()
    logits = logits.float()
    std = ref.std(dim=-1)
    top = logits.argmax(dim=-1)
    agree = top == ref.argmax(dim=-1)
    gap = (ref.max(dim=-1).values - ref.gather(1, top[:, None])[:, 0]) / std
    rms = (logits - ref).pow(2).mean(dim=-1).sqrt() / std
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return {"agree": agree, "gap": gap, "rms": rms, "kl": kl}


def summarize_positions(name: str, errs: dict[str, torch.Tensor]) -> dict:
    n = int(errs["agree"].numel())
    return {"run": name, "positions": n, "argmax_agree": int(errs["agree"].sum()),
            "mean_gap_sigma": float(errs["gap"].mean()), "worst_gap_sigma": float(errs["gap"].max()),
            "mean_rms_sigma": float(errs["rms"].mean()), "mean_kl": float(errs["kl"].mean())}


def paired(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], key: str = "rms") -> dict:
    """Mean of a[key] - b[key] over the shared positions, its standard error, and a / b of the means."""
    d = (a[key] - b[key]).double()
    n = d.numel()
    return {"metric": key, "mean_diff": float(d.mean()), "se": float(d.std() / n**0.5) if n > 1 else float("nan"),
            "ratio": float(a[key].mean() / b[key].mean())}
