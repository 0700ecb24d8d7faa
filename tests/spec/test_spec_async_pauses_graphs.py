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
    # token budget 8: the step-cost table profiles 1..8 tokens (graph replays), cheap under the interpreter
    on = make(parts, speculative_method="mtp", num_speculative_tokens=1, speculative_adaptive=True,
              max_num_batched_tokens=8)
    spec = on._spec
    spec.policy.cost, spec.policy.draft_cost = FLAT, None
    spec.book = MTPSnapshots(on)
    spec.policy.paused, spec.policy.probe = PAUSE, False
    before = replays(on)
    got, _ = run(on, parts[4], replace(GREEDY, max_tokens=14, logprobs=None))
    return on, got, replays(on) - before


def test_async_pause_steps_replay_graphs_and_keep_their_rows_from_the_graph_buffer(parts, monkeypatch):
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
