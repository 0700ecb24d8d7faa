"""Train stdlib-coder: seeded and reproducible (same data, same seed, same steps -> the same run on the same
GPU and software), bf16 autocast over fp32 master weights, AdamW with warmup + cosine decay.

Loss = next-token cross-entropy + MTP_WEIGHT * the MTP module's next-next-token cross-entropy (DeepSeek-V3
report, eq. 24-25) + a tiny sequence-wise balance loss; the router's correction bias is updated after
every step by the auxiliary-loss-free rule. The held-out loss is measured every `--eval-every` steps and
the curve is saved with the checkpoint (train_log.json), which export.py writes in DeepSeek's format.

    python -m tools.stdlib_coder.train --data .gpu/stdlib_data --out /tmp/stdlib-coder --steps 1500
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

from tools.stdlib_coder.export import write_checkpoint
from tools.stdlib_coder.model import TrainingV3, V3Shape

MTP_WEIGHT = 0.3
BALANCE_WEIGHT = 1e-4
BIAS_UPDATE_SPEED = 1e-3

SHAPE = V3Shape(
    vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=128,
    qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
    n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    max_position_embeddings=4096, num_nextn_predict_layers=1,
)


def batches(stream: np.ndarray, batch: int, seq: int, gen: torch.Generator):
    n = stream.size - seq - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen).tolist()
        yield torch.from_numpy(np.stack([stream[s: s + seq + 1] for s in starts]).astype(np.int64))


def eval_windows(stream: np.ndarray, seq: int, max_windows: int) -> torch.Tensor:
    n = min(stream.size // (seq + 1), max_windows)
    return torch.from_numpy(stream[: n * (seq + 1)].astype(np.int64).reshape(n, seq + 1))


@torch.no_grad()
def evaluate(model: TrainingV3, windows: torch.Tensor, device: torch.device, batch: int) -> dict:
    model.eval()
    tot_main = tot_mtp = 0.0
    count = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main, mtp, _ = model.losses(w)
        tot_main += main.item() * w.shape[0]
        tot_mtp += (mtp.item() if mtp is not None else 0.0) * w.shape[0]
        count += w.shape[0]
    model.train()
    return {"held_out_loss": tot_main / count, "held_out_mtp_loss": tot_mtp / count}


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args) -> None:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    train_ids = np.load(os.path.join(args.data, "train.npy"))
    held_ids = np.load(os.path.join(args.data, "held_out.npy"))
    model = TrainingV3(SHAPE).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    step_fn = torch.compile(model.losses) if args.compile else model.losses
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.batch, args.seq, gen)
    windows = eval_windows(held_ids, args.seq, args.eval_windows)
    log: dict = {"shape": SHAPE.__dict__, "args": vars(args), "curve": []}
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        tokens = next(data).to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main, mtp, bal = step_fn(tokens)
            loss = main + MTP_WEIGHT * mtp + BALANCE_WEIGHT * bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_router_bias(BIAS_UPDATE_SPEED)
        if step % args.log_every == 0 or step == args.steps - 1:
            entry = {"step": step, "tokens_seen": (step + 1) * args.batch * args.seq, "train_loss": main.item(),
                     "train_mtp_loss": mtp.item(), "lr": opt.param_groups[0]["lr"], "seconds": time.time() - t0}
            if step % args.eval_every == 0 or step == args.steps - 1:
                entry.update(evaluate(model, windows, device, args.batch))
            log["curve"].append(entry)
            print(json.dumps(entry), flush=True)
    log["train_seconds"] = time.time() - t0
    log["tokens_seen"] = args.steps * args.batch * args.seq
    log["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    log["torch"] = torch.__version__
    model.eval()
    os.makedirs(args.out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out, "training_state.pt"))
    write_checkpoint(model, args.out, fp8=True)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="directory with train.npy / held_out.npy (data.py)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true")
    train(ap.parse_args())


if __name__ == "__main__":
    main()
