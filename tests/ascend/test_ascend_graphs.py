"""Decode graphs over the fake: its record-and-replay NPUGraph stand-in (against eager torch), the
per-replay update of npu_fused_infer_attention_score's host lengths, and the ascend graph runner with the
fused MLA op replaying equal to eager as the sequence lengths change. The fake is a CPU stand-in that
re-runs recorded ops; it checks the wiring and the freeze / update semantics, not ACL's graph engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.backend import KVCaches, KVCacheSpec, StaticInputs
from deepinfer.backend.specs import MLASpec

FIA_MLA = MLASpec(num_heads=2, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                  softmax_scale=192**-0.5)
BS, NB = 16, 8


def _paged_inputs(g, b=2):
    q = torch.randn(b, 1, 2, 512, generator=g).half()
    q_rope = torch.randn(b, 1, 2, 64, generator=g).half()
    lat = torch.randn(NB, BS, 512, generator=g).half()
    rope = torch.randn(NB, BS, 64, generator=g).half()
    table = torch.arange(b * 3, dtype=torch.int32).view(b, 3)
    kw = dict(query_rope=q_rope, key_rope=rope, num_heads=2, num_key_value_heads=1, input_layout="BSND",
              scale=0.1, block_table=table, block_size=BS, sparse_mode=0)
    return q, lat, kw


def test_fake_graph_replays_recorded_ops_on_current_inputs(fake_npu):
    npu = fake_npu.npu
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    g = npu.NPUGraph()
    with npu.graph(g):
        y = fake_npu.npu_rms_norm((x @ w).half(), torch.ones(8).half(), epsilon=1e-6)[0].float().relu()
    for _ in range(2):
        x.copy_(torch.randn(4, 8))
        g.replay()
        ref = fake_npu.npu_rms_norm((x @ w).half(), torch.ones(8).half(), epsilon=1e-6)[0].float().relu()
        assert torch.equal(y, ref)


def test_fake_capture_refuses_host_syncs(fake_npu):
    npu, x = fake_npu.npu, torch.randn(4)
    for bad in (lambda: x.sum().item(), lambda: x[x > 0], lambda: bool((x > 0).all())):
        with pytest.raises(RuntimeError, match="fake NPUGraph"):
            with npu.graph(npu.NPUGraph()):
                bad()


def test_host_lengths_freeze_unless_the_task_is_updated(fake_npu):
    """The freeze a real capture has, and the documented update that lifts it."""
    from deepinfer.backends.ascend import graph_tasks

    npu = fake_npu.npu
    q, lat, kw = _paged_inputs(torch.Generator().manual_seed(0))
    first, second = (fake_npu.npu_fused_infer_attention_score(q, lat, lat, actual_seq_lengths_kv=n, **kw)[0]
                     for n in ([5, 30], [17, 2]))
    g = npu.NPUGraph()
    with graph_tasks.recording(fake_npu) as rec, npu.graph(g):
        out = graph_tasks.fused_attention(fake_npu, q, lat, lat, [5, 30], **kw)
    out.zero_()
    g.replay()
    assert torch.equal(out, first)
    g.replay()  # no update: still the captured lengths
    assert not torch.equal(out, second)
    graph_tasks.update_tasks(fake_npu, npu.Stream(), rec.tasks, [17, 2])
    g.replay()
    assert torch.equal(out, second)
    assert {"event.wait", "event.reset", "event.record"} <= set(npu.EVENTS)


class _MLAModel:
    """One fused MLA layer over fixed q / kv rows scaled by the step's input ids (so replays see new inputs)."""

    def __init__(self, op, g):
        self.op = op
        self.q = torch.randn(4, 2, 192, generator=g).half()
        self.kv_c = torch.randn(4, 512, generator=g).half()
        self.k_pe = torch.randn(4, 64, generator=g).half()

    def forward(self, batch, caches):
        b = batch.input_ids.shape[0]
        s = (1 + batch.input_ids[:, None].half() / 8)
        return self.op.forward(self.q[:b] * s[:, :, None], self.kv_c[:b] * s, self.k_pe[:b] * s,
                               caches.get("mla", 0), batch, "mla")


def _decode_batch(lens: list[int], ids: list[int]):
    b = len(lens)
    st = StaticInputs.allocate(b, 3, ["mla"], torch.device("cpu"))
    st.input_ids.copy_(torch.tensor(ids))
    st.positions.copy_(torch.tensor(lens) - 1)
    st.seq_lens.copy_(torch.tensor(lens))
    st.context_lens.copy_(torch.tensor(lens) - 1)
    for i in range(b):  # request i owns blocks 2i, 2i+1
        st.block_tables["mla"][i, :2] = torch.tensor([2 * i, 2 * i + 1])
        st.slot_mapping["mla"][i] = (2 * i + (lens[i] - 1) // BS) * BS + (lens[i] - 1) % BS
    return dataclasses.replace(st.batch(b, BS), seq_lens_cpu=lens, context_lens_cpu=[n - 1 for n in lens])


def test_graph_runner_replays_the_fused_mla_equal_to_eager_as_lengths_change(ascend):
    from deepinfer.backends.ascend.graph_runner import NPUGraphRunner

    g = torch.Generator().manual_seed(1)
    op = ascend.make_mla_attention(FIA_MLA)
    op.load_kv_b_proj(torch.randn(2 * 256, 512, generator=g).half() / 16)
    spec = KVCacheSpec("mla", (0,), (576,), torch.float16, components=(("latent", 512), ("rope", 64)))
    caches = KVCaches.allocate([spec], {"mla": NB}, BS, 4, torch.device("cpu"),
                               layouts={"mla": ascend.kv_cache_layout(spec)})
    for part in caches.get("mla", 0):
        part.copy_(torch.randn(part.shape, generator=g).half())
    model = _MLAModel(op, g)
    runner = NPUGraphRunner.capture(model, caches, BS, 2 * BS, 4, torch.device("cpu"), buckets=[2, 4])
    assert [len(runner.graphs[b][1]) for b in (2, 4)] == [1, 1]  # one updatable attention task per graph
    for lens, ids in (([5, 9, 17], [1, 2, 3]), ([6, 10, 18], [4, 5, 6]), ([20, 3], [7, 8]), ([32], [9])):
        batch = _decode_batch(lens, ids)
        assert runner.can_run(batch)
        replayed = runner.run(batch).clone()
        eager = model.forward(batch, caches)
        assert torch.equal(replayed, eager), lens


def test_layout_declares_the_stored_rope_order_and_join_restores_the_contracts(ascend):
    from deepinfer.backends.ascend.mla_attention import ROPE_ORDER, _permute_rope

    spec = KVCacheSpec("mla", (0,), (576,), torch.float16, components=(("latent", 512), ("rope", 64)))
    layout = ascend.kv_cache_layout(spec)
    assert layout.parts[1].order == ROPE_ORDER and layout.parts[0].order is None
    cache = torch.randn(2, BS, 576).half()
    latent, rope = layout.split(cache)
    assert torch.equal(rope, _permute_rope(cache[..., 512:])) and torch.equal(layout.join((latent, rope)), cache)
