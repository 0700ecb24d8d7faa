"""Held-out perplexity and the MTP module's first-draft acceptance, on the shipped (fp8) weights.

Runs the training-time model (tools/stdlib_coder/model.py) loaded from the exported checkpoint, so the
numbers are those of the weights DeepInfer serves; tests/models/test_stdlib_coder_model.py checks that this
model, transformers and DeepInfer agree on them.

- perplexity: exp(mean next-token cross-entropy) over the held-out files' token stream, cut into windows of
  `--seq` + 1 tokens (no overlap; every window starts cold, so this is an upper bound); also bits per byte.
- MTP first-draft acceptance: at every held-out position i, the MTP module's greedy draft for token i+2
  (from the main model's hidden state at i and the true token i+1) is accepted when it equals the main
  model's own greedy prediction at i+1: what a speculative decoder's first draft slot would get, teacher-
  forced on real text.

    python -m tools.stdlib_coder.evaluate_heldout --model deepinfer/data/stdlib-coder --data .gpu/stdlib_data
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from tools.stdlib_coder.export import load_into
from tools.stdlib_coder.model import TrainingV3, V3Shape


def load_model(model_dir: str, device: torch.device) -> TrainingV3:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    model = TrainingV3(V3Shape.from_hf(cfg))
    load_into(model, model_dir)
    return model.to(device).eval()


@torch.no_grad()
def heldout_metrics(model: TrainingV3, stream: np.ndarray, seq: int, batch: int, device: torch.device,
                    max_windows: int | None = None) -> dict:
    n = stream.size // (seq + 1)
    if max_windows:
        n = min(n, max_windows)
    windows = torch.from_numpy(stream[: n * (seq + 1)].astype(np.int64).reshape(n, seq + 1))
    nll = 0.0
    tokens = accepted = drafts = mtp_correct = 0
    for i in range(0, n, batch):
        w = windows[i: i + batch].to(device)
        ids, targets = w[:, :-1], w[:, 1:]
        h = model.hidden(ids)
        logits = model.lm_head(h).float()
        nll += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        tokens += targets.numel()
        draft = model.lm_head(model.mtp_hidden(h[:, :-1], ids[:, 1:])).float().argmax(-1)  # token i+2
        main_next_next = logits[:, 1:].argmax(-1)
        accepted += (draft == main_next_next).sum().item()
        mtp_correct += (draft == targets[:, 1:]).sum().item()
        drafts += draft.numel()
    return {"windows": n, "seq": seq, "tokens": tokens, "mean_nll": nll / tokens, "perplexity": math.exp(nll / tokens),
            "mtp_first_draft_acceptance": accepted / drafts, "mtp_draft_equals_text": mtp_correct / drafts,
            "positions": drafts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="directory with held_out.npy and data_info.json (data.py)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    device = torch.device(args.device)
    model = load_model(args.model, device)
    stream = np.load(os.path.join(args.data, "held_out.npy"))
    res = heldout_metrics(model, stream, args.seq, args.batch, device, args.max_windows)
    with open(os.path.join(args.data, "data_info.json")) as f:
        info = json.load(f)
    # bits per byte over the windows evaluated (UTF-8 bytes ~ chars for the stdlib's mostly-ASCII sources)
    frac = res["tokens"] / max(1, info["held_out_tokens"])
    res["bits_per_char"] = res["mean_nll"] * res["tokens"] / math.log(2) / (info["held_out_chars"] * frac)
    res["python"] = info["python"]
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
