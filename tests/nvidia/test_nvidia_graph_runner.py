"""Decode CUDA-graph runner: bucket / eligibility logic on the CPU, capture + replay vs eager on the GPU."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import ON_GPU  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.backend.forward_batch import ForwardBatch
from deepinfer.backends.nvidia.graph_runner import CUDAGraphRunner, default_buckets

PAGE = 16


def _batch(ctx: list[int], qlen: list[int], tables: list[list[int]], group: str, device) -> ForwardBatch:
    ids, pos, slots, qsl = [], [], [], [0]
    for c, q, row in zip(ctx, qlen, tables):
        for p in range(c, c + q):
            ids.append(7 + p % 50)
            pos.append(p)
            slots.append(row[p // PAGE] * PAGE + p % PAGE)
        qsl.append(qsl[-1] + q)
    width = max(len(r) for r in tables)
    bt = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, r in enumerate(tables):
        bt[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    seq = [c + q for c, q in zip(ctx, qlen)]
    return ForwardBatch(
        input_ids=torch.tensor(ids, device=device), positions=torch.tensor(pos, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_tables={group: bt.to(device)}, slot_mapping={group: torch.tensor(slots, device=device)},
        logits_indices=torch.tensor([x - 1 for x in qsl[1:]], device=device),
        query_lens_cpu=list(qlen), seq_lens_cpu=seq, context_lens_cpu=list(ctx), block_size=PAGE,
    )


def test_default_buckets():
    assert default_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert default_buckets(5) == [1, 2, 4, 5]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_bucket_and_eligibility_without_capture():
    runner = CUDAGraphRunner(model=None, caches=None, block_size=PAGE, max_blocks_per_seq=4, buckets=[1, 2, 4],
                             group_names=["mla"])
    assert [runner.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    dev = torch.device("cpu")
    assert runner.can_run(_batch([5, 9, 3], [1, 1, 1], [[0], [1], [2]], "mla", dev))
    assert not runner.can_run(_batch([0, 9], [5, 1], [[0], [1]], "mla", dev))  # a prefill row
    assert not runner.can_run(_batch([1] * 5, [1] * 5, [[i] for i in range(5)], "mla", dev))  # above the buckets
    assert not runner.can_run(_batch([70], [1], [[0, 1, 2, 3, 4]], "mla", dev))  # table wider than captured
    assert not runner.can_run(_batch([3], [1], [[0]], "other", dev))  # another KV group layout


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="graph capture needs a CUDA GPU")
def test_graph_replay_matches_eager_decode(tmp_path):
    from deepinfer.backend.kv_caches import KVCaches
    from deepinfer.backends.nvidia.backend import NvidiaBackend
    from deepinfer.checkpoints import make_checkpoint
    from deepinfer.models.registry import load_model

    make_checkpoint("tiny-v2-lite", str(tmp_path / "ckpt"))
    backend = NvidiaBackend(device="cuda")
    model = load_model(str(tmp_path / "ckpt"), backend, torch.float32, progress=False)
    specs = model.kv_cache_specs()
    group = specs[0].name
    dev = backend.device

    def caches():
        return KVCaches.allocate(specs, {s.name: 32 for s in specs}, PAGE, 8, dev)

    eager_caches, graph_caches = caches(), caches()
    runner = CUDAGraphRunner.capture(model, graph_caches, PAGE, max_model_len=64, max_num_seqs=4, device=dev,
                                     buckets=[1, 2, 4])
    tables = [[0, 1], [2, 3], [4, 5]]
    prompts = _batch([0, 0, 0], [5, 17, 3], tables, group, dev)
    with torch.inference_mode():
        model.forward(prompts, eager_caches)
        model.forward(prompts, graph_caches)
        step = _batch([5, 17, 3], [1, 1, 1], tables, group, dev)
        assert runner.can_run(step)
        eager = model.forward(step, eager_caches)
        replay = runner.run(step).clone()
    torch.testing.assert_close(replay, eager, rtol=1e-4, atol=1e-4)
    for key in eager_caches.kv:
        torch.testing.assert_close(graph_caches.kv[key], eager_caches.kv[key], rtol=1e-4, atol=1e-4)
