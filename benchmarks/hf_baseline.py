"""Hugging Face transformers on the same GPU: a throughput baseline and a teacher-forcing accuracy check.

Accuracy: for the greedy tokens DeepInfer produced (throughput.py
--accuracy-out), run HF's forward over prompt + generated tokens, one
sequence at a time, and check that each DeepInfer token is HF's argmax or
within --tol of HF's row maximum (random bf16 weights put the top logits
closer together than bf16 resolves; NOTES.md).
Throughput: HF generate, greedy, at small batches (HF's MoE loops over
experts in Python, so it is run short).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--accuracy-in", default=None)
    p.add_argument("--tol", type=float, default=0.05, help="allowed logit gap below HF's max, relative to its logit std")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    load_s = time.perf_counter() - t0
    print(json.dumps({"bench": "hf", "transformers": transformers.__version__, "load_s": load_s,
                      "gpu": torch.cuda.get_device_name()}), flush=True)

    if args.accuracy_in:
        with open(args.accuracy_in) as f:
            data = json.load(f)
        exact = within = total = 0
        worst = 0.0
        for prompt, gen in zip(data["prompts"], data["outputs"]):
            ids = torch.tensor([prompt + gen[:-1]], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 :].float()
            for row, tok in zip(logits, gen):
                gap = float(row.max() - row[tok]) / float(row.std())
                exact += int(int(row.argmax()) == tok)
                within += int(gap <= args.tol)
                worst = max(worst, gap)
                total += 1
        print(json.dumps({"bench": "accuracy", "tokens": total, "argmax_match": exact / total,
                          "within_tol": within / total, "tol_in_logit_std": args.tol,
                          "worst_gap_in_logit_std": worst}), flush=True)

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        ids = torch.randint(10, vocab - 10, (b, args.prompt_len), generator=g).cuda()
        mask = torch.ones_like(ids)
        kw = dict(do_sample=False, attention_mask=mask, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            torch.cuda.synchronize()
            t_prefill = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kw)
            torch.cuda.synchronize()
            t_all = time.perf_counter() - t
        step_ms = 1e3 * (t_all - t_prefill) / (args.new_tokens - 1)
        print(json.dumps({"bench": "hf", "batch": b, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                          "prefill_tok_s": b * args.prompt_len / t_prefill, "decode_ms_per_step": step_ms,
                          "output_tok_s": b / step_ms * 1e3}), flush=True)


if __name__ == "__main__":
    main()
