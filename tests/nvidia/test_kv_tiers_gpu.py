"""The KV tiers' copies on a real GPU (kv/tier_copies.py, NvidiaBackend's copy services).

Run on the GPU machine:  python -m pytest -q tests/nvidia/test_kv_tiers_gpu.py
- the copy stream is not the compute stream, copy_async returns before the copy is done, and a copy issued
  before a compute kernel overlaps it (the pair takes clearly less than the two alone);
- with async scheduling, decode graphs and a host tier: a host-tier hit gives bitwise the logprobs of a device
  hit (the same suffix computed over the same KV bytes) and the miss's tokens; the schedule() calls that
  evict to the host tier and queue the prefetch never make the host wait for the device (sync debug mode).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu

SYSTEM = [0] + [(11 * i + 5) % 900 + 2 for i in range(127)]  # 128 tokens: eight 16-token blocks
OTHER = [[0] + [(97 * i + 13 * j) % 900 + 2 for j in range(200)] for i in range(6)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from deepinfer.checkpoints import make_checkpoint

    def build(preset: str) -> str:
        path = str(tmp_path_factory.mktemp(preset.replace("-", "_")))
        make_checkpoint(preset, path, progress=False)
        return path

    return build


def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_copy_stream_overlaps_compute():
    _need_gpu()
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    be = NvidiaBackend(device="cuda")
    stream = be.copy_stream()
    assert stream is not None and stream != torch.cuda.current_stream()
    src = torch.randn(64 * 1024 * 1024, device="cuda")  # 256 MiB: ~5-10 ms over PCIe
    dst = be.host_buffer(tuple(src.shape), src.dtype)
    assert dst.is_pinned()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def copy():
        be.event_synchronize(be.copy_async([dst], [src], stream))

    for _ in range(2):  # warm
        timed(copy)
        timed(lambda: a @ a)
    copy_s = timed(copy)
    reps = max(1, round(copy_s / timed(lambda: [a @ a for _ in range(10)]) * 10))  # compute ~ as long as the copy

    def compute():
        for _ in range(reps):
            a @ a

    compute_s = timed(compute)
    torch.cuda.synchronize()
    t = time.perf_counter()
    event = be.copy_async([dst], [src], stream)
    issue_s = time.perf_counter() - t
    assert not be.event_done(event) and issue_s < copy_s / 2, "copy_async should not wait for the copy"
    compute()  # queued on the compute stream, not behind the copy
    torch.cuda.synchronize()
    both_s = time.perf_counter() - t
    assert torch.equal(dst[:1024], src[:1024].cpu())
    # serial would be copy + compute; overlapped, the shorter one is mostly hidden
    assert both_s < copy_s + compute_s - 0.5 * min(copy_s, compute_s), (copy_s, compute_s, both_s)


def _engines(checkpoint, host_gib):
    from deepinfer import EngineConfig
    from deepinfer.engine import DeepInferenceEngine

    path = checkpoint("tiny-v2-lite")
    kw = dict(model_name_or_path=path, device="cuda", dtype="float32", max_model_len=320, num_kv_blocks=24,
              block_size=16, max_num_seqs=8, load_progress=False, async_scheduling=True)
    return (DeepInferenceEngine.from_config(EngineConfig(**kw, enable_prefix_caching=False)),
            DeepInferenceEngine.from_config(EngineConfig(**kw, kv_host_cache_gib=host_gib)))


def test_host_hit_is_bitwise_a_device_hit_and_schedule_never_syncs(checkpoint):
    _need_gpu()
    from deepinfer import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    miss_e, e = _engines(checkpoint, 0.05)
    assert e.async_scheduling and e.runner.graph_runner is not None, "expected async scheduling with graphs"
    assert e.kv._tier.copies.stream is not None, "the tiers should copy on the nvidia copy stream"
    prompt = SYSTEM + [41, 42, 43, 44, 45]

    def trace(out):
        c = out.outputs[0]
        return list(c.token_ids), [sorted((t, lp.logprob) for t, lp in s.items()) for s in c.logprobs]

    e.generate([SYSTEM + [7]], greedy, use_tqdm=False)
    device_hit = e.generate([prompt], greedy, use_tqdm=False)[0]
    assert device_hit.num_cached_tokens == 128 and e.kv.prefix_tier_hit_tokens == 0

    schedule, synced = e.scheduler.schedule, []

    def strict_schedule():  # evictions and prefetches are queued here: none may make the host wait
        torch.cuda.set_sync_debug_mode("error")
        try:
            return schedule()
        except RuntimeError as exc:
            synced.append(str(exc))
            raise
        finally:
            torch.cuda.set_sync_debug_mode("default")

    e.scheduler.schedule = strict_schedule
    try:
        for p in OTHER:  # push SYSTEM's blocks down to the host tier
            e.generate([p], greedy, use_tqdm=False)
        host_hit = e.generate([prompt], greedy, use_tqdm=False)[0]
    finally:
        e.scheduler.schedule = schedule
    assert not synced
    copies = e.kv._tier.copies
    assert copies.num_to_host > 0 and copies.num_to_device >= 8
    assert host_hit.num_cached_tokens == 128 and e.kv.prefix_tier_hit_tokens == 128
    assert trace(host_hit) == trace(device_hit)  # bitwise: the same KV bytes, the same suffix computation
    miss = miss_e.generate([prompt], greedy, use_tqdm=False)[0]
    assert miss.outputs[0].token_ids == host_hit.outputs[0].token_ids
