"""Train stdlib-coder-v4 (tools/stdlib_coder/v4_model.py): a small DeepSeek-V4 with one MTP module on the stdlib
corpus, with the embedded stdlib-coder's tokenizer. Seeded; fp32 on the CPU (bf16 autocast on a GPU); AdamW with
warmup + cosine decay (train.py's schedule); loss = next-token cross-entropy + MTP_WEIGHT x the MTP module's
next-next-token cross-entropy (DeepSeek-V3 report, eq. 24-25); the routers' correction bias updated after every
step by the auxiliary-loss-free rule. The held-out curve (loss, MTP loss, MTP top-1 on the held-out text) is saved
beside the checkpoint (train_log.json).

    python -m tools.stdlib_coder.data deepinfer/data/stdlib-coder /tmp/stdlib_data
    python -m tools.stdlib_coder.train_v4 --data /tmp/stdlib_data --out /tmp/stdlib-coder-v4 --steps 1200

Not the embedded model: a checkpoint for measuring V4's MTP drafting (docs/speculative.md, "V4").
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from tools.stdlib_coder.train import BIAS_UPDATE_SPEED, MTP_WEIGHT, batches, eval_windows, lr_at
from tools.stdlib_coder.v4_model import TrainingV4, cross_entropies, stdlib_v4_config

TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "deepinfer", "data", "stdlib-coder")


@torch.no_grad()
def evaluate(model: TrainingV4, windows: torch.Tensor, device: torch.device, batch: int) -> dict:
    """Held-out loss, MTP loss, and the MTP module's top-1 accuracy on the text (a teacher-forced proxy of its
    acceptance: the engine checks drafts against the model's own tokens, `benchmarks.speculative --model`)."""
    model.eval()
    tot_main = tot_mtp = 0.0
    hits = positions = count = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch].to(device)
        logits, mtp_logits = model.forward_logits(w)
        main, mtp = cross_entropies(w, logits, mtp_logits)
        tot_main += main.item() * w.shape[0]
        tot_mtp += mtp.item() * w.shape[0]
        hits += int((mtp_logits[:, :-1].argmax(-1) == w[:, 2:]).sum())
        positions += w[:, 2:].numel()
        count += w.shape[0]
    model.train()
    return {"held_out_loss": tot_main / count, "held_out_mtp_loss": tot_mtp / count,
            "held_out_mtp_top1": hits / positions}


def train(args) -> None:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    train_ids = np.load(os.path.join(args.data, "train.npy"))
    held_ids = np.load(os.path.join(args.data, "held_out.npy"))
    with open(os.path.join(args.tokenizer, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]  # the embedded tokenizer's, special tokens included
    cfg = stdlib_v4_config(vocab)
    model = TrainingV4(cfg, args.seed).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and (p.dim() < 2 or "embed" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.batch, args.seq, gen)
    windows = eval_windows(held_ids, args.seq, args.eval_windows)
    log: dict = {"config": cfg, "args": vars(args), "curve": []}
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        tokens = next(data).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main, mtp = model.losses(tokens)
            loss = main + MTP_WEIGHT * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        model.update_router_bias(BIAS_UPDATE_SPEED)
        if step % args.log_every == 0 or step == args.steps - 1:
            entry = {"step": step, "tokens_seen": (step + 1) * args.batch * args.seq, "train_loss": main.item(),
                     "train_mtp_loss": mtp.item(), "lr": opt.param_groups[0]["lr"], "seconds": time.time() - t0}
            if step % args.eval_every == 0 or step == args.steps - 1:
                entry.update(evaluate(model, windows, device, args.batch))
            log["curve"].append(entry)
            print(json.dumps(entry), flush=True)
        if args.export_every and step and step % args.export_every == 0:  # a usable checkpoint if stopped early
            model.export(args.out, args.tokenizer)
    log.update(train_seconds=time.time() - t0, tokens_seen=args.steps * args.batch * args.seq,
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__)
    model.eval()
    model.export(args.out, args.tokenizer)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="directory with train.npy / held_out.npy (data.py)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=os.path.normpath(TOKENIZER_DIR),
                    help="the tokenizer's directory (default: the embedded stdlib-coder's)")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--export-every", type=int, default=400)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    train(args)


if __name__ == "__main__":
    main()
