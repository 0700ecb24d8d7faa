"""Async scheduling on a real GPU: same tokens as sync, and a decode step's launch never syncs.

Run on the GPU machine:  python -m pytest -q tests/engine/test_engine_async_scheduling_gpu.py
The launch check runs every decode-only launch (CUDA-graph replay) under
torch.cuda.set_sync_debug_mode("error"), which raises on any call that makes the host wait for
the device (a blocking host-to-device copy, .item(), .tolist(), a stream sync): one of those
would silently serialize the host with the device and undo the overlap.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import EngineConfig, SamplingParams
from deepinfer.engine import DeepInferenceEngine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_engines(checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = checkpoint("tiny-v2-lite")
    return [DeepInferenceEngine.from_config(EngineConfig(
        model_name_or_path=path, device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=64,
        max_num_seqs=16, load_progress=False, async_scheduling=a)) for a in (False, True)]


def _decode_only(sched) -> bool:
    return all(it.num_tokens == 1 for it in sched.scheduled)


def test_async_equals_sync_and_decode_launch_never_syncs(gpu_engines):
    sync, asy = gpu_engines
    assert asy.async_scheduling and not sync.async_scheduling
    assert asy.runner.graph_runner is not None, "expected decode CUDA graphs on the GPU"
    launch = asy.runner.launch
    checked = []

    def strict_launch(sched):
        if not _decode_only(sched):
            return launch(sched)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = launch(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(len(sched.scheduled))
        return step

    asy.runner.launch = strict_launch
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 64, 3)]
        params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(6)]
        params[1] = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=5, max_tokens=20, ignore_eos=True,
                                   logprobs=2)
        a = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync.generate(prompts, params, use_tqdm=False)]
        b = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in asy.generate(prompts, params, use_tqdm=False)]
    finally:
        asy.runner.launch = launch
    assert a == b
    assert len(checked) > 10  # many decode launches ran under the sync check
    assert asy.stats().kv_blocks_used == 0 and sync.stats().kv_blocks_used == 0


def test_step_timer_times_every_launch(gpu_engines):
    """worker/step_timer.py: one event set per launched step, phases that add up to about the step's
    device time, a host wait per resolved draw and a host launch time per launch."""
    from deepinfer.worker.step_timer import PHASES, StepTimer

    _, asy = gpu_engines
    timer = asy.runner.timer = StepTimer(torch.device("cuda"))
    try:
        asy.add_request("timed", list(range(10, 40)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        while asy.has_unfinished_requests():
            asy.step()
    finally:
        asy.runner.timer = None
    assert len(timer.steps) >= 12  # the prefill and 11 decodes
    assert all(set(s) == set(PHASES) for s in timer.steps)
    out = timer.summary()
    assert out["timed_steps"] == len(timer.steps) and out["device_ms"] > 0
    parts = sum(out[f"{a}_to_{b}_ms"] for a, b in zip(PHASES, PHASES[1:]))
    assert parts == pytest.approx(out["device_ms"], rel=0.5)  # medians of the parts vs median of the whole
    assert len(timer.host_wait_s) >= 12 and len(timer.host_launch_s) == len(timer.steps)
