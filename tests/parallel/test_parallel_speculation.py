"""Speculative decoding with tensor parallelism on the CPU (gloo): every rank runs the same speculative step (its
shard of the verify forward, the MTP module's pass and chain, split like the main model's layers), the logits are
gathered over "tp" before the draw and the drafts' argmax, so the ranks draft, verify and roll back alike, in
lockstep; the adaptive scheduler's measured times are tp rank 0's on every rank (spec/shared_times.py).
Data-parallel replicas are refused (a replica's step runs several forwards the other replicas would not meet)."""

from __future__ import annotations

import functools
import os
import sys

import pytest
from script_runner import run_script

import deepinfer


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory) -> str:
    """tiny-v3 with an MTP module (tests/parallel/mtp_checkpoint.py)."""
    from mtp_checkpoint import with_mtp

    from deepinfer.checkpoints import make_checkpoint

    root = str(tmp_path_factory.mktemp("tp-spec"))
    make_checkpoint("tiny-v3", os.path.join(root, "tiny-v3"), seed=0)
    return with_mtp(root, os.path.join(root, "tiny-v3"), "v3-mtp")


@functools.cache
def _one_process(path: str, max_tokens: int) -> tuple[list, list]:
    """Greedy and seeded tokens of engine_script's prompts, one process, no speculation (made once per checkpoint and
    max_tokens: the n-gram parametrizations share theirs, so do V4's two)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from engine_script import PROMPTS

    from deepinfer import LLM, SamplingParams

    llm = LLM(path, device="cpu", load_progress=False, max_model_len=128)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seeded = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=1234)
    return ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)],
            [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)])


@pytest.mark.parametrize("method,max_tokens,ep,adaptive", [
    ("mtp", 6, False, False), ("ngram", 40, False, False), ("ngram", 40, True, False),
    ("mtp", 24, False, True), ("ngram", 40, False, True),
])
def test_tp2_speculation_equals_one_process_without_it(v3_mtp, method, max_tokens, ep, adaptive):
    """TP=2 with drafts of 3: greedy and seeded tokens equal the one-process engine without speculation. MTP: the
    module split like the main model's layers (its random eh_proj drafts what the model rejects: every draft rolled
    back); n-gram over 40 tokens: tiny-v3 repeats itself enough that some drafts are accepted; with the experts
    spread over the two ranks (expert parallelism inside the one replica: every forward's dispatch meets); and the
    adaptive scheduler, whose plans and admissions read measured times: tp rank 0's on both ranks
    (spec/shared_times.py), or the ranks' batches would part and their collectives time out."""
    want_greedy, want_seeded = _one_process(v3_mtp, max_tokens)
    got = run_script("generate", v3_mtp, {"tensor_parallel_size": 2, "speculative_method": method,
                                          "num_speculative_tokens": 3, "max_tokens": max_tokens,
                                          "enable_expert_parallel": ep, "speculative_adaptive": adaptive})
    assert got["greedy"] == want_greedy
    assert got["seeded"] == want_seeded
    assert got["alone"] == want_greedy[0]
    st = got["stats"]
    assert st["spec_drafted_tokens"] > 0, st
    if method == "ngram" and not adaptive:  # (adaptive verifies what its measured times say pays: on a busy
        assert 0 < st["spec_accepted_tokens"] < st["spec_drafted_tokens"], st  # machine possibly nothing)


def test_speculation_with_data_parallel_replicas_is_refused():
    """Refused before any process starts, with its reason."""
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.config import EngineConfig
    from deepinfer.engine.parallel_setup import join_parallel_job
    from deepinfer.errors import ConfigError
    from deepinfer.models.registry import load_hf_config

    path = deepinfer.embedded_model_path()  # (the refusals come before any shape is read)
    cfg = EngineConfig(path, speculative_method="mtp", data_parallel_size=2)
    with pytest.raises(ConfigError, match="with data-parallel replicas"):
        join_parallel_job(cfg, CPUBackend(), load_hf_config(path))


def _agree_on_two_ranks(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.spec.shared_times import SharedTimes

    times = SharedTimes(CPUBackend().make_communicator(dist.group.WORLD, "tp"), torch.device("cpu"))
    got = [times.agree([0.001 * (rank + 1), 2.5 + rank, -1.0]) for _ in range(3)]  # each rank measured its own
    return {"got": got, "agreed": times.num_agreed}


def test_shared_times_give_every_rank_tp_rank_zeros_values():
    """spec/shared_times.py over two gloo ranks: whatever each rank measured, both read rank 0's values (so their
    adaptive plans cannot part); with one rank the values pass through and nothing is sent."""
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.parallel.local_ranks import run_local_ranks
    from deepinfer.spec.shared_times import SharedTimes

    out = run_local_ranks(_agree_on_two_ranks, 2, timeout_s=120)
    assert [r["got"] for r in out] == [[[0.001, 2.5, -1.0]] * 3] * 2
    assert [r["agreed"] for r in out] == [3, 3]
    alone = SharedTimes.for_backend(CPUBackend())
    assert alone.comm is None and alone.agree([0.3, 0.7]) == [0.3, 0.7] and alone.num_agreed == 0


@pytest.mark.parametrize("ep", [False, True])
def test_tp2_v4_mtp_speculation_equals_one_process_without_it(checkpoint, ep):
    """tiny-v4 at TP=2 (its experts split over tp, or spread over the two ranks) with V4's MTP module drafting 3:
    greedy and seeded tokens equal the one-process engine without speculation (the module's own logits under TP:
    tests/parallel/test_v4_parallel.py)."""
    path = checkpoint("tiny-v4")
    want_greedy, want_seeded = _one_process(path, 8)
    got = run_script("generate", path, {"tensor_parallel_size": 2, "speculative_method": "mtp",
                                        "num_speculative_tokens": 3, "max_tokens": 8, "enable_expert_parallel": ep,
                                        "speculative_adaptive": False})
    assert got["greedy"] == want_greedy and got["seeded"] == want_seeded and got["alone"] == want_greedy[0]
    assert got["stats"]["spec_drafted_tokens"] > 0
