"""Async pause steps (spec/async_pauses.py) on an engine that replays decode graphs: the nvidia backend under the
Triton interpreter over the stand-in graph API of test_spec_nvidia_interpreter.py, whose replay rewrites one
output buffer per bucket, as a captured device graph does. A delegated step replays the decode graph
(runner.launch), and its hidden-state tap must copy the decode rows out of that buffer before the next replay
rewrites it: the MTP KV after an async pause equals that after the same pause run sync, and the output is off's.
Tiny shapes, fp32 (the drafting checkpoint of that module)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from mtp_snapshots import MTPSnapshots, first_after_pause
from test_spec_nvidia_interpreter import (
    ALPHA,
    DEVICE,
    GREEDY,
    TINY,
    GraphNvidiaBackend,
    make,
    make_drafting_checkpoint,
    prompts,
    replays,
    run,
)

from deepinfer import SamplingParams
from deepinfer.models.registry import load_model
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.text.tokenizer import Tokenizer

FLAT = StepCostTable([1, 4096], [10.0, 10.1])  # drafting always pays: no pause but the one the test sets
PAUSE = 9


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec-async-graphs"))
    perm = make_drafting_checkpoint(path, "tiny-v3", TINY, ALPHA, torch.float32)
    backend = GraphNvidiaBackend(device=DEVICE)
    model = load_model(path, backend, torch.float32, progress=False, load_mtp=True)
    return path, backend, model, Tokenizer.from_pretrained(path), prompts(perm)


def paused_run(parts, monkeypatch, async_pauses: bool):
    monkeypatch.setenv("DEEPINFER_SPEC_ASYNC_PAUSES", "1" if async_pauses else "0")
    # token budget 8: the prompts prefill in chunks; the start-up profiles are skipped (`unprofiled`): the tables
    # are set below
    on = make(parts, speculative_method="mtp", num_speculative_tokens=1, speculative_adaptive=True,
              max_num_batched_tokens=8)
    spec = on._spec
    spec.policy.cost, spec.policy.draft_cost = FLAT, None
    spec.book = MTPSnapshots(on)
    spec.policy.paused, spec.policy.probe = PAUSE, False
    before = replays(on)
    got, _ = run(on, parts[4], replace(GREEDY, max_tokens=14, logprobs=None))
    return on, got, replays(on) - before


def test_async_pause_steps_replay_graphs_and_keep_their_rows_from_the_graph_buffer(parts, monkeypatch, unprofiled):
    ps = parts[4]
    want, _ = run(make(parts, enforce_eager=True), ps, replace(GREEDY, max_tokens=14, logprobs=None))
    sync, got_sync, _ = paused_run(parts, monkeypatch, False)
    on, got, graph_steps = paused_run(parts, monkeypatch, True)
    assert got == want and got_sync == want
    pauses = on._spec.async_pauses
    # the prompts' chunks (budget 8) and the pause's last step ran the spec path, the decode steps between were
    # delegated, each a graph replay
    assert pauses.num_steps >= 3 and pauses.sync_steps["prompt"] >= 2 and graph_steps >= pauses.num_steps
    # the same rows caught up as with the pause run sync: the delegated steps' decode rows, every sequence
    assert on._spec.paused_rows.num_caught_up == sync._spec.paused_rows.num_caught_up >= len(ps) * pauses.num_steps
    a, b = on._spec.book.seen, sync._spec.book.seen
    assert a.keys() == b.keys()
    for prompt in {p for p, _ in a}:
        n = first_after_pause(a, prompt)
        torch.testing.assert_close(a[(prompt, n)][0], b[(prompt, n)][0], rtol=1e-5, atol=1e-5)
    assert on.stats().kv_blocks_used == 0 and len(on._spec.paused_rows) == 0


# ---------------------------------------------------------------- GPU (not run yet: no GPU in this session)

NO_PAY = StepCostTable([1, 4096], [1.0, 4096.0])  # a second per token: a verified draft never pays
CODE = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
        "def parse_args(argv):\n    parser = "]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_async_pauses_are_on_by_default_and_equal_sync_pauses(monkeypatch):
    """The embedded model, bf16, CUDA graphs, real async scheduling (pinned copies, events): an adaptive engine
    whose drafts never pay runs its pauses async by default on a GPU, and its tokens are those of the same engine
    with DEEPINFER_SPEC_ASYNC_PAUSES=0 (a delegated decode step replays the same decode graph and sampler as a sync
    pause step, so even bf16 gives the same bits), and the MTP KV its drafts see after the pauses is the sync
    pauses' (the tap's copies ran on the stream before the next replay rewrote the graph's output)."""
    import deepinfer
    from deepinfer import EngineConfig
    from deepinfer.backends.nvidia.backend import NvidiaBackend
    from deepinfer.engine import DeepInferenceEngine

    path = deepinfer.embedded_model_path()
    backend = NvidiaBackend(device="cuda")
    model = load_model(path, backend, torch.bfloat16, progress=False, load_mtp=True)
    tok = Tokenizer.from_pretrained(path)

    def engine(env: str | None):
        if env is None:
            monkeypatch.delenv("DEEPINFER_SPEC_ASYNC_PAUSES", raising=False)
        else:
            monkeypatch.setenv("DEEPINFER_SPEC_ASYNC_PAUSES", env)
        cfg = EngineConfig(model_name_or_path=path, device="cuda", dtype="bfloat16", max_model_len=512,
                           max_num_seqs=16, load_progress=False, speculative_method="mtp", num_speculative_tokens=3,
                           speculative_adaptive=True)
        e = DeepInferenceEngine.from_components(cfg, model, tok, backend)
        e._spec.policy.cost = NO_PAY
        e._spec.policy.realized.decides = False  # the tables pause both alike (measured rates differ run to run)
        e._spec.book = MTPSnapshots(e)
        return e

    on, sync = engine(None), engine("0")
    assert on.runner.graph_runner is not None
    assert on._spec.async_pauses is not None and sync._spec.async_pauses is None
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in on.generate(CODE, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in sync.generate(CODE, params, use_tqdm=False)]
    assert got == want
    pauses = on._spec.async_pauses
    assert pauses.num_steps >= 30 and pauses.inner.num_sync_fallbacks == 0, (pauses.num_steps, pauses.sync_steps)
    a, b = on._spec.book.seen, sync._spec.book.seen
    assert a.keys() == b.keys() and len(a) > len(CODE)  # drafts after the first pause (probes)
    for key in a:
        torch.testing.assert_close(a[key][0].float(), b[key][0].float(), rtol=2e-2, atol=2e-2)
    assert on.stats().kv_blocks_used == 0 and len(on._spec.paused_rows) == 0
