"""Accuracy of the quantized linear schemes on the embedded trained model (issue 18), teacher-forced, on the CPU.

What is compared: the same held-out windows of the stdlib-coder evaluation split (docs/models.md: the CPython
3.11.7 stdlib files whose path hash mod 100 is < 5, each file BOS + tokens + EOS, cut into windows that start
cold) run through DeepInfer's model on the cpu backend in fp32, once per scheme:

- reference: the shipped fp8 weights dequantized to fp32 and stored dense (scheme "none");
- none (rerun): the reference model again, a control (agreement must be exactly 1, gaps 0);
- fp8_block: the fp8 checkpoint as shipped (dequantized at load, W8A16): another control;
- none bf16: the dense copy computed in bf16 (the engine's default dtype; the noise bf16 itself brings);
- fp8_w8a8: the fp8 checkpoint with `quantization="fp8"` (activations quantized per token per 128 channels);
- fp8_w8a8 online: the dense fp32 copy quantized at load (`quantization="fp8"` on a dense checkpoint);
- int4_awq / int4_gptq: AWQ / GPTQ copies written by deepinfer/checkpoints/awq_writer.py from the dense copy
  (round-to-nearest, group 128, no activation-aware search or GPTQ error feedback);
- int8_w8a8: an msModelSlim W8A8_DYNAMIC copy written by w8a8_writer.py (per-channel weights, per-token acts).

The cpu backend's quantized linear methods are the dequantize-then-compute oracles of the conformance suite,
so this measures each scheme's rounding of weights / activations, not a GPU kernel's arithmetic. Routed
experts and MLA's kv_b_proj (absorbed into the attention op, not a `Linear`) run with their weights rounded as
the scheme stores them and their activations not quantized: kv_b_proj dequantized at load; the routed experts
of int4_awq / int4_gptq kept int4 by the cpu MoE op (every expert projection of this model is int4 at group
128; each expert is dequantized for its turn, the same values as dequantizing at load), the others dequantized. The LM head stays
dense except under online fp8, whose load quantizes it too (each row reports its head's scheme).

Per scheme, over every position of every window: top-1 agreement with the reference's argmax; |logprob gap|
of the reference's argmax token (mean and max); perplexity of the held-out text next to the reference's;
mean KL(reference || scheme).

    python -m benchmarks.quant_accuracy                      # the full run (about 10 minutes on 2 busy cores)
    python -m benchmarks.quant_accuracy --windows 8 --seq 256
    python -m benchmarks.quant_accuracy --dry-run            # tiny, for CI (tests/quant/)

Prints one JSON line per scheme ("bench": "quant_accuracy") and a table; --json-out writes all of it.
Results go to docs/quantization.md ("Accuracy") with date, machine, command and commit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

SCHEMES = ("reference", "none (rerun)", "fp8_block", "none bf16", "fp8_w8a8", "fp8_w8a8 online",
           "int4_awq", "int4_gptq", "int8_w8a8")
DRY_SCHEMES = ("reference", "none (rerun)", "fp8_w8a8", "int4_awq", "int8_w8a8")


@dataclass
class Tally:
    """Sums over the positions of every window for one scheme."""

    tokens: int = 0
    agree: int = 0
    gap_sum: float = 0.0
    gap_max: float = 0.0
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    window_agreement: list[float] = field(default_factory=list)
    # the reference's own top-1 minus top-2 logprob where this scheme picks another token: near-ties or not
    disagree_margins: list[float] = field(default_factory=list)
    bf16_agree: int = 0

    def add(self, lp: torch.Tensor, ref_lp: torch.Tensor, targets: torch.Tensor,
            bf16_lp: torch.Tensor | None = None) -> None:
        """lp, ref_lp: fp32 log-softmax [T, V]; targets [T] (the text's next tokens); bf16_lp: the bf16 row's."""
        ref_top = ref_lp.argmax(-1)
        top = lp.argmax(-1)
        same = top == ref_top
        agree = int(same.sum())
        if not bool(same.all()):
            two = ref_lp[~same].topk(2, dim=-1).values
            self.disagree_margins += (two[:, 0] - two[:, 1]).tolist()
        if bf16_lp is not None:
            self.bf16_agree += int((top == bf16_lp.argmax(-1)).sum())
        gap = (lp.gather(1, ref_top[:, None]) - ref_lp.gather(1, ref_top[:, None])).abs().squeeze(1)
        self.tokens += len(targets)
        self.agree += agree
        self.window_agreement.append(agree / len(targets))
        self.gap_sum += float(gap.double().sum())
        self.gap_max = max(self.gap_max, float(gap.max()))
        self.nll_sum += float(-lp.gather(1, targets[:, None]).double().sum())
        self.kl_sum += float((ref_lp.exp() * (ref_lp - lp)).sum(-1).double().sum())

    def summary(self) -> dict:
        return {"tokens": self.tokens, "top1_agreement": self.agree / self.tokens,
                "disagreements": self.tokens - self.agree,
                "min_window_agreement": min(self.window_agreement),
                "mean_abs_logprob_gap": self.gap_sum / self.tokens, "max_abs_logprob_gap": self.gap_max,
                "mean_nll": self.nll_sum / self.tokens, "perplexity": math.exp(self.nll_sum / self.tokens),
                "mean_kl": self.kl_sum / self.tokens,
                "median_ref_margin_at_disagreement": (float(torch.tensor(self.disagree_margins).median())
                                                      if self.disagree_margins else None),
                "max_ref_margin_at_disagreement": max(self.disagree_margins, default=None),
                "top1_agreement_vs_bf16": self.bf16_agree / self.tokens}


# ------------------------------------------------------------------ data


def heldout_windows(model_dir: str, n: int, seq: int, spread: bool = True) -> tuple[list[list[int]], dict]:
    """n windows of seq + 1 tokens of the held-out stream (each starts cold): evenly spread over the whole
    stream, or (spread=False, the dry run: tokenizing all 75 files takes seconds) the first n of it."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/ of the checkout
    from tools.stdlib_coder.corpus import python_version, split, stdlib_files
    from tools.stdlib_coder.data import encode_files

    _, held = split(stdlib_files())
    if not held:
        raise SystemExit("no held-out stdlib files found (tools/stdlib_coder/corpus.py)")
    texts = [f.text for f in held]
    if not spread:  # only as many files, in order, as the first n windows need
        used = 1
        while used < len(texts) and encode_files(model_dir, texts[:used]).size < n * (seq + 1):
            used = min(len(texts), used * 2)
        texts = texts[:used]
    stream = encode_files(model_dir, texts).astype("int64")
    total = stream.size // (seq + 1)
    if n > total:
        raise SystemExit(f"--windows {n}: the held-out stream holds only {total} windows of {seq + 1} tokens")
    picks = [round(i * (total - 1) / max(1, n - 1)) for i in range(n)] if spread and n > 1 else list(range(n))
    windows = [stream[p * (seq + 1):(p + 1) * (seq + 1)].tolist() for p in picks]
    return windows, {"python": python_version(), "held_out_files": len(held), "files_tokenized": len(texts),
                     "tokens_tokenized": int(stream.size), "windows_available": total, "window_indices": picks}


# ------------------------------------------------------------------ checkpoints


def write_dense_copy(src: str, dst: str) -> list[str]:
    """The fp8 checkpoint with every e4m3 weight dequantized to fp32 (weight_scale_inv dropped): the reference."""
    from safetensors.torch import load_file, save_file

    from deepinfer.backend import dequant_fp8_block

    t = load_file(os.path.join(src, "model.safetensors"))
    out, done = {}, []
    for name, w in t.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            out[name] = dequant_fp8_block(w, t[name + "_scale_inv"]).contiguous()
            done.append(name[: -len(".weight")])
        else:
            out[name] = w
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    for extra in os.listdir(src):
        if extra not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(src, extra), os.path.join(dst, extra))
    return done


def load(path: str, backend, dtype: torch.dtype, quantization: str | None, expect: str):
    """The model as the engine would load it (flag + checkpoint -> settings, quant_config.resolve_linear_quant);
    checks that every decoder linear runs the scheme this row claims to measure."""
    from deepinfer.models.layers.linear import Linear
    from deepinfer.models.layers.quant import use_linear_quant
    from deepinfer.models.registry import load_hf_config, load_model
    from deepinfer.quant_config import resolve_linear_quant

    hf = load_hf_config(path)
    settings, _ = resolve_linear_quant(quantization, None, hf)
    with use_linear_quant(settings):
        model = load_model(path, backend, dtype, progress=False, hf_config=hf)
    schemes: dict[str, int] = {}
    head = None
    for m in model.modules():
        if isinstance(m, Linear) and m.name == "lm_head":  # reported apart: online fp8 quantizes it too
            head = m.method.scheme
        elif isinstance(m, Linear):
            schemes[m.method.scheme] = schemes.get(m.method.scheme, 0) + 1
    if set(schemes) != {expect}:
        raise SystemExit(f"{path}: decoder linears run {schemes}, expected all {expect!r}")
    return model.eval(), {"decoder": schemes, "lm_head": head}


# ------------------------------------------------------------------ forward


@torch.no_grad()
def window_logprobs(model, ids: list[int], block_size: int) -> torch.Tensor:
    """fp32 log-softmax [T, V] at every position of one sequence, prefilled in one forward from an empty cache."""
    from deepinfer.backend import ForwardBatch, KVCaches, token_slots

    specs = model.kv_cache_specs()
    t = len(ids)
    nblocks = -(-t // block_size)
    caches = KVCaches.allocate(specs, {s.name: nblocks for s in specs}, block_size, 1, torch.device("cpu"))
    table = torch.arange(nblocks, dtype=torch.int32)[None]
    pos = torch.arange(t, dtype=torch.int64)
    req = torch.zeros(t, dtype=torch.int64)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64), positions=pos,
        query_start_loc=torch.tensor([0, t], dtype=torch.int32), seq_lens=torch.tensor([t], dtype=torch.int32),
        context_lens=torch.zeros(1, dtype=torch.int32), block_tables={s.name: table for s in specs},
        slot_mapping={s.name: token_slots(table, req, pos, s.tokens_per_entry, block_size) for s in specs},
        logits_indices=pos, query_lens_cpu=[t], seq_lens_cpu=[t], context_lens_cpu=[0],
        state_slots=torch.zeros(1, dtype=torch.int32) if caches.state else None,
        state_slots_cpu=[0] if caches.state else [], block_size=block_size)
    logits = model.compute_logits(model.forward(batch, caches)[batch.logits_indices]).float()
    return torch.log_softmax(logits, dim=-1)


# ------------------------------------------------------------------ main


def build_models(names: tuple[str, ...], work: str, backend) -> tuple[dict, dict]:
    """name -> loaded model, and what each row is (schemes of its linears, dense layers, source)."""
    import deepinfer
    from deepinfer.checkpoints.awq_writer import write_int4_checkpoint
    from deepinfer.checkpoints.w8a8_writer import write_w8a8_checkpoint

    fp8_dir = deepinfer.embedded_model_path()
    dense = os.path.join(work, "dense-fp32")
    dense_linears = write_dense_copy(fp8_dir, dense)
    f32, bf16 = torch.float32, torch.bfloat16
    models, info = {}, {}
    for name in names:
        extra: dict = {}
        if name in ("reference", "none (rerun)"):
            if "reference" not in models:
                models["reference"] = load(dense, backend, f32, None, "none")
            models[name] = models["reference"]
            info[name] = {"linears": models[name][1]["decoder"], "lm_head": models[name][1]["lm_head"],
                          "source": "fp8 weights dequantized to fp32"}
            continue
        if name == "fp8_block":
            m = load(fp8_dir, backend, f32, None, "fp8_block")
        elif name == "none bf16":
            m = load(dense, backend, bf16, None, "none")
        elif name == "fp8_w8a8":
            m = load(fp8_dir, backend, f32, "fp8", "fp8_w8a8")
        elif name == "fp8_w8a8 online":
            m = load(dense, backend, f32, "fp8", "fp8_w8a8")
        elif name in ("int4_awq", "int4_gptq"):
            dst = os.path.join(work, name)
            done = write_int4_checkpoint(dense, dst, name.split("_")[1])
            extra["stayed_dense"] = sorted(p for p in dense_linears if p not in done)
            m = load(dst, backend, f32, None, name)
        elif name == "int8_w8a8":
            dst = os.path.join(work, name)
            done = write_w8a8_checkpoint(dense, dst)
            extra["stayed_dense"] = sorted(p for p in dense_linears if p not in done)
            m = load(dst, backend, f32, None, name)
        else:
            raise SystemExit(f"--schemes: unknown scheme {name!r} (known: {', '.join(SCHEMES)})")
        models[name] = m
        info[name] = {"linears": m[1]["decoder"], "lm_head": m[1]["lm_head"], **extra}
    return {k: v[0] for k, v in models.items()}, info


def run(args: argparse.Namespace) -> dict:
    import deepinfer
    from deepinfer.backends.cpu.backend import CPUBackend

    names = tuple(args.schemes) if args.schemes else (DRY_SCHEMES if args.dry_run else SCHEMES)
    if "reference" not in names:
        names = ("reference",) + names
    t0 = time.perf_counter()
    windows, data = heldout_windows(deepinfer.embedded_model_path(), args.windows, args.seq,
                                   spread=not args.dry_run)
    backend = CPUBackend()
    block = backend.caps.kv_block_sizes[0]
    work = tempfile.mkdtemp(prefix="deepinfer-quant-acc-")
    try:
        models, info = build_models(names, work, backend)
        setup_s = time.perf_counter() - t0
        tallies = {n: Tally() for n in names}
        for i, w in enumerate(windows):
            print(f"window {i + 1}/{len(windows)}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            ids, targets = w[:-1], torch.tensor(w[1:])
            lps = {n: window_logprobs(models[n], ids, block) for n in names}
            ref, bf16 = lps["reference"], lps.get("none bf16")
            for n in names:
                tallies[n].add(lps[n], ref, targets, bf16)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ref_ppl = tallies["reference"].summary()["perplexity"]
    rows = []
    for n in names:
        s = tallies[n].summary()
        if "none bf16" not in names:
            s.pop("top1_agreement_vs_bf16")
        rows.append({"bench": "quant_accuracy", "scheme": n, **s, "perplexity_vs_reference": s["perplexity"] / ref_ppl,
                     **info[n]})
    return {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()},
            "args": {k: v for k, v in vars(args).items() if k != "json_out"}, "data": data,
            "setup_s": setup_s, "total_s": time.perf_counter() - t0, "results": rows}


def print_table(out: dict) -> None:
    print(f"\n{'scheme':16s} {'tokens':>7s} {'top-1 agree':>11s} {'mean |Δlp|':>10s} {'max |Δlp|':>9s} "
          f"{'ppl':>7s} {'ppl/ref':>8s} {'mean KL':>9s} {'margin@dis':>10s} {'vs bf16':>8s}")
    for r in out["results"]:
        margin = r["median_ref_margin_at_disagreement"]
        vs_bf16 = r.get("top1_agreement_vs_bf16")
        print(f"{r['scheme']:16s} {r['tokens']:7d} {100 * r['top1_agreement']:10.2f}% "
              f"{r['mean_abs_logprob_gap']:10.4f} {r['max_abs_logprob_gap']:9.3f} {r['perplexity']:7.3f} {r['perplexity_vs_reference']:8.4f} "
              f"{r['mean_kl']:9.5f} {'-' if margin is None else f'{margin:.4f}':>10s} "
              f"{'-' if vs_bf16 is None else f'{100 * vs_bf16:.2f}%':>8s}")
    d = out["data"]
    print(f"({len(d['window_indices'])} windows of {out['args']['seq']} positions from {d['held_out_files']} held-out "
          f"files, Python {d['python']}; setup {out['setup_s']:.1f} s, total {out['total_s']:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=None, help="held-out windows (default 32; dry run 2)")
    p.add_argument("--seq", type=int, default=None, help="positions per window (default 1024; dry run 32)")
    p.add_argument("--schemes", nargs="+", default=None, help=f"rows to run (default all: {', '.join(SCHEMES)})")
    p.add_argument("--dry-run", action="store_true", help="tiny run for CI: 2 windows of 32, fewer rows")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.windows = args.windows if args.windows is not None else (2 if args.dry_run else 32)
    args.seq = args.seq if args.seq is not None else (32 if args.dry_run else 1024)
    if args.windows < 1 or args.seq < 2:
        p.error("--windows must be >= 1 and --seq >= 2")
    for n in args.schemes or ():
        if n not in SCHEMES:
            p.error(f"--schemes: unknown scheme {n!r} (known: {', '.join(SCHEMES)})")
    out = run(args)
    for r in out["results"]:
        print(json.dumps(r), flush=True)
    print_table(out)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
