"""bf16 accuracy against fp32, DeepInfer next to transformers' own bf16 (issue 14's numerics check).

The measure (NOTES.md, "bf16 accuracy"): run greedy decoding in bf16, teacher-force the greedy tokens through
the fp32 transformers reference on the same weights, and take each token's gap below the fp32 row maximum in
row standard deviations: (max(row) - row[token]) / std(row). transformers' own bf16 greedy run, measured the
same way, is the noise bf16 allows. Both runs start from the same prompts and decode independently.

    python -m benchmarks.accuracy_bf16 --device nvidia            # the H200
    python -m benchmarks.accuracy_bf16 --device cpu --prompts 3   # a smaller look on the CPU

--fp32-router etc. are not flags of the engine: this tool only measures. It prints one JSON line per run and
a table; results go to docs/determinism.md (numerics section) with date, GPU, command and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 96, (n,), generator=g).tolist()
    return [[0] + torch.randint(2, vocab, (m - 1,), generator=g).tolist() for m in lengths]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int, device: str) -> list[int]:
    """Greedy tokens by full forwards (not generate(): no logits processors, no cache differences)."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1]
        tok = int(logits.float().argmax())
        out.append(tok)
        ids.append(tok)
    return out


@torch.no_grad()
def gaps(ref, prompt: list[int], gen: list[int], device: str) -> list[float]:
    ids = torch.tensor([prompt + gen[:-1]], device=device)
    logits = ref(ids).logits[0, len(prompt) - 1:].float()
    return [float(row.max() - row[t]) / float(row.std()) for row, t in zip(logits, gen)]


@torch.no_grad()
def teacher_forced(engine, hf16, ref, ps: list[list[int]], streams: list[list[int]], device: str) -> dict:
    """Every run's logits on the same stream (prompt + the fp32 greedy tokens), against the fp32 reference's at
    each position (benchmarks/teacher_forced.py): DeepInfer's prefill and decode forms, transformers' bf16."""
    from benchmarks.teacher_forced import deepinfer_logits, paired, position_errors, summarize_positions

    errs: dict[str, dict[str, list[torch.Tensor]]] = {}
    for q, gen in zip(ps, streams):
        ids = q + gen[:-1]
        first = len(q) - 1
        x = torch.tensor([ids], device=device)
        rows32 = ref(x).logits[0, first:].float()
        vocab = rows32.shape[-1]
        rows = {"deepinfer-bf16 decode": deepinfer_logits(engine, ids, first, "decode"),
                "deepinfer-bf16 prefill": deepinfer_logits(engine, ids, first, "prefill"),
                "transformers-bf16": hf16(x).logits[0, first:].float()}
        for name, r in rows.items():
            for k, v in position_errors(r[:, :vocab].to(rows32.device), rows32).items():
                errs.setdefault(name, {}).setdefault(k, []).append(v.cpu())
    cat = {name: {k: torch.cat(v) for k, v in e.items()} for name, e in errs.items()}
    hf = cat["transformers-bf16"]
    return {"runs": [summarize_positions(name, e) for name, e in cat.items()],
            "paired": {f"{name} - transformers-bf16": paired(cat[name], hf, "rms")
                       for name in cat if name != "transformers-bf16"}}


def summarize(name: str, all_gaps: list[float]) -> dict:
    t = torch.tensor(all_gaps)
    return {"run": name, "tokens": len(all_gaps), "exact_argmax": int((t == 0).sum()),
            "worst_gap_sigma": float(t.max()), "mean_gap_sigma": float(t.mean()),
            "p99_gap_sigma": float(t.quantile(0.99)) if len(all_gaps) > 1 else float(t.max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="nvidia", help="DeepInfer backend (nvidia, cpu)")
    p.add_argument("--preset", default="acc-v3-1k")
    p.add_argument("--checkpoint", default=None, help="an existing checkpoint instead of the preset")
    p.add_argument("--prompts", type=int, default=7)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM

    from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams
    from deepinfer.checkpoints import make_checkpoint

    transformers.logging.set_verbosity_error()
    torch_device = "cuda" if args.device == "nvidia" else "cpu"
    path = args.checkpoint
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="deepinfer-acc-"), args.preset)
        make_checkpoint(args.preset, path, seed=args.seed)
    cfg = json.load(open(os.path.join(path, "config.json")))
    ps = prompts(cfg["vocab_size"], args.prompts, args.seed)

    results = []
    t0 = time.perf_counter()
    # the pool is sized, not taken from free memory: the transformers models share the GPU with this engine
    engine = DeepInferenceEngine(EngineConfig(path, device=args.device, dtype="bfloat16", load_progress=False,
                                              max_model_len=256, num_kv_blocks=1024,
                                              enable_prefix_caching=False))
    outs = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True),
                           use_tqdm=False)
    di_tokens = [list(o.outputs[0].token_ids) for o in outs]
    di_s = time.perf_counter() - t0

    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(torch_device).eval()
    hf_tokens = [hf_greedy(hf16, q, args.new_tokens, torch_device) for q in ps]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(torch_device).eval()
    ref32_tokens = [hf_greedy(ref, q, args.new_tokens, torch_device) for q in ps]
    forced = teacher_forced(engine, hf16, ref, ps, ref32_tokens, torch_device)
    del engine, hf16

    for name, toks in (("deepinfer-bf16", di_tokens), ("transformers-bf16", hf_tokens),
                       ("transformers-fp32 (control)", ref32_tokens)):
        g = [x for q, gen in zip(ps, toks) for x in gaps(ref, q, gen, torch_device)]
        r = summarize(name, g)
        r["same_as_fp32_greedy"] = sum(a == b for t, u in zip(toks, ref32_tokens) for a, b in zip(t, u))
        results.append(r)
        print(json.dumps({"bench": "accuracy_bf16", "device": args.device, "preset": args.preset, **r}), flush=True)

    print(f"\n{'run':30s} {'tokens':>6s} {'argmax':>7s} {'worst σ':>8s} {'p99 σ':>7s} {'mean σ':>7s}")
    for r in results:
        print(f"{r['run']:30s} {r['tokens']:6d} {r['exact_argmax']:7d} {r['worst_gap_sigma']:8.3f} "
              f"{r['p99_gap_sigma']:7.3f} {r['mean_gap_sigma']:7.4f}")
    print(f"(deepinfer run {di_s:.1f} s incl. load)")
    print("\nteacher-forced on the fp32 greedy stream (paired: the same positions for every run)")
    print(f"{'run':30s} {'pos':>5s} {'argmax':>7s} {'mean gap σ':>11s} {'worst σ':>8s} {'rms σ':>8s} {'KL':>9s}")
    for r in forced["runs"]:
        print(f"{r['run']:30s} {r['positions']:5d} {r['argmax_agree']:7d} {r['mean_gap_sigma']:11.4f} "
              f"{r['worst_gap_sigma']:8.3f} {r['mean_rms_sigma']:8.5f} {r['mean_kl']:9.2e}")
    for name, d in forced["paired"].items():
        print(f"paired {name}: {d['metric']} mean difference {d['mean_diff']:+.5f} ± {d['se']:.5f} (se), "
              f"ratio of means {d['ratio']:.3f}")
    print(json.dumps({"bench": "accuracy_bf16_forced", "device": args.device, "preset": args.preset, **forced}))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": args.device, "preset": args.preset, "results": results, "teacher_forced": forced},
                      f, indent=2)


if __name__ == "__main__":
    main()
