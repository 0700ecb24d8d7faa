"""Host cost of evicting KV blocks into the host tier, per block, on the CPU (issue 15).

Why: on the H200 an 8k host-tier hit evicts ~128 blocks to make room for itself, and the tier link's eviction
callback cost ~0.42 ms per block on the host, about the whole host-hit TTFT. This measures that path alone,
without a model: a KVCacheManager with a realistic group (V2-Lite's MLA latent: 576 values per token, bf16,
64-token blocks, --layers layers), its pool linked to a host tier (and optionally a disk tier) exactly as the
engine links them (attach_tiers), the cpu backend's copy services.

Each repetition keys --blocks device blocks with fresh keys, frees them (they become evictable), then times one
allocation of --blocks blocks, which evicts them all into the host tier. Reported: host microseconds per
evicted block (best of --reps, and the median), the pool's own bookkeeping measured alone (on_evict off), and
the tier link's phases where it records them (TierLink.timings: seconds per phase, time.perf_counter).

  python -m benchmarks.kv_evict_cost --blocks 128 --layers 4 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from deepinfer.backend import KVCaches, KVCacheSpec
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.kv.host_tier import HostTier
from deepinfer.kv.manager import KVCacheManager
from deepinfer.worker.kv_block_io import KVBlockIO


def _setup(args):
    spec = KVCacheSpec("mla", tuple(range(args.layers)), (args.entry,), getattr(torch, args.dtype))
    kv = KVCacheManager([spec], {"mla": args.blocks}, args.block_size, 2, args.blocks * args.block_size,
                        prefix_caching=True)
    caches = KVCaches.allocate([spec], {"mla": args.blocks}, args.block_size, 2, torch.device("cpu"))
    for layer in spec.layer_ids:
        caches.get("mla", layer).normal_()
    kv.use_backend(CPUBackend())
    disk = None
    if args.disk:
        from deepinfer.kv.disk_tier import DiskTier
        disk = DiskTier(args.disk, 1 << 40, 72.0, b"kv-evict-cost")
    kv.attach_tiers(HostTier(int(args.host_gib * 1024**3)), disk, KVBlockIO(caches, "mla"))
    return kv, kv.pools["mla"]


def _one(pool, rep: int, n: int, evict: bool) -> float:
    """Key n blocks with keys of this rep, free them, time the allocation that evicts them."""
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.register(b, rep.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(24))
    pool.free(blocks)
    hook = pool.on_evict
    if not evict:
        pool.on_evict = None
    t = time.perf_counter()
    got = pool.allocate(n)
    dt = time.perf_counter() - t
    pool.on_evict = hook
    pool.free(got)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=128, help="blocks evicted per repetition")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--entry", type=int, default=576, help="values per token per layer (MLA latent + rope key)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--host-gib", type=float, default=1.0)
    ap.add_argument("--disk", default=None, help="also link a disk tier in this directory")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.disk:
        os.makedirs(args.disk, exist_ok=True)
    kv, pool = _setup(args)
    link = kv._tier
    timings = None
    if hasattr(link, "timings"):  # the link records its phases when given a dict
        timings = link.timings = {}
    n = args.blocks
    _one(pool, 10**6, n, True)  # warm-up: first-touch of buffers, lazy imports
    base = min(_one(pool, 2 * 10**6 + r, n, False) for r in range(args.reps))
    if timings is not None:
        timings.clear()
    runs = [_one(pool, r, n, True) for r in range(args.reps)]
    block_bytes = sum(t.numel() * t.element_size() for t in link.block_io.like())
    row = {"blocks": n, "block_kib": block_bytes / 1024, "layers": args.layers,
           "us_per_block_best": min(runs) / n * 1e6, "us_per_block_median": statistics.median(runs) / n * 1e6,
           "pool_only_us_per_block": base / n * 1e6, "reps": args.reps,
           "copy_calls": link.copies.num_calls, "transfers": link.copies.num_transfers}
    if timings:
        row["phases_us_per_block"] = {k: v / (n * args.reps) * 1e6 for k, v in timings.items()}
    print(json.dumps(row))
    if args.disk and kv.disk_tier is not None:
        kv.disk_tier.flush()


if __name__ == "__main__":
    main()
