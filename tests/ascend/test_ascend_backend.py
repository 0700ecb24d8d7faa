"""The ascend backend over the fake torch_npu: the conformance suite, MLA at the shapes the fused
operators take, the Triton router (interpreted), the HCCL communicator's code over gloo, the graph runner."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from deepinfer.backend import FeatureRequest, NativeOps, OpSpec, RouterSpec
from deepinfer.backend.specs import MLASpec
from deepinfer.conformance.layer_cases import mla_cases, mla_latent_cases
from deepinfer.conformance.runner import _Reference, run_conformance, to_device

FIA_MLA = MLASpec(num_heads=2, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                  softmax_scale=192**-0.5)


def test_conformance_suite_passes_over_the_fake(ascend):
    report = run_conformance(ascend, dtypes=(torch.bfloat16, torch.float16),
                             ops=[o for o in ("rms_norm", "add_rms_norm", "silu_and_mul", "route", "moe",
                                              "kv_cache_write", "rotary_embedding", "linear:none", "mla_attention")])
    assert report.ok, report.format_table()
    impls = {(r.op, r.impl) for r in report.rows if r.status == "pass"}
    assert {("rms_norm", "npu_rms_norm"), ("route", "npu_moe_gating_top_k"), ("silu_and_mul", "npu_swiglu")} <= impls
    assert any(op == "moe" and "npu_grouped_matmul" in impl for op, impl in impls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_on_the_fused_operators_matches_native(ascend, dtype):
    batches = {"prefill": ([7], [0]), "decode": ([1, 1, 1], [9, 20, 1]), "mixed chunked": ([5, 1, 3], [0, 12, 17])}
    cases = mla_cases(FIA_MLA, 16, batches) + mla_latent_cases(FIA_MLA, 16, {"mixed": ([5, 1], [0, 12])})
    assert "npu_fused_infer_attention_score" in ascend.op_impl(OpSpec("mla_attention", dtype, FIA_MLA))
    for i, case in enumerate(cases):
        inputs = case.make(torch.Generator().manual_seed(i), dtype)
        out = case.run(ascend, to_device(inputs, ascend.device))
        ref = case.run(_Reference(), inputs)
        for a, b in zip(out, ref):
            assert torch.allclose(a.float(), b.float(), atol=5e-2, rtol=5e-2), case.name


def test_mla_needs_the_split_layout_it_declares(ascend):
    from deepinfer.backend import BackendError, KVCacheSpec

    spec = KVCacheSpec("mla", (0,), (576,), torch.bfloat16, components=(("latent", 512), ("rope", 64)))
    assert [p.name for p in ascend.kv_cache_layout(spec).parts] == ["latent", "rope"]
    op = ascend.make_mla_attention(FIA_MLA)
    op.load_kv_b_proj(torch.zeros(2 * 256, 512, dtype=torch.bfloat16))
    with pytest.raises(BackendError, match="split layout"):
        op._parts(torch.zeros(2, 16, 576))


def test_triton_softmax_router_matches_native(fake_npu):
    from deepinfer.backends.ascend.router_kernel import softmax_greedy_topk
    from deepinfer.backends.ascend.routing import route_impl

    for spec in (RouterSpec(64, 6, "softmax", "greedy"),
                 RouterSpec(20, 3, "softmax", "greedy", norm_topk_prob=True, routed_scaling_factor=2.0)):
        logits = torch.randn(5, spec.num_experts, generator=torch.Generator().manual_seed(0)) * 3
        w, ids = softmax_greedy_topk(logits, spec.top_k, spec.norm_topk_prob, spec.routed_scaling_factor)
        rw, rids = NativeOps().route(logits, spec)
        assert torch.equal(ids, rids) and torch.allclose(w, rw, atol=1e-6)
    # the op's 7.1.0-era limits (before torch_npu 2.7.1) leave V2-Lite's 64 experts to the kernel
    assert route_impl(RouterSpec(64, 6, "softmax", "greedy"), (2, 6, 0), kernels=True) == "triton"
    assert route_impl(RouterSpec(64, 6, "softmax", "greedy"), (2, 13, 0), kernels=True) == "gating_top_k"
    v3 = RouterSpec(256, 8, "sigmoid", "noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True)
    assert route_impl(v3, (2, 6, 0), kernels=True) == "gating_top_k"
    assert route_impl(RouterSpec(32, 4, "sqrtsoftplus", "hash"), (2, 13, 0), True).startswith("native (")


def test_caps_tell_the_truth(ascend):
    caps = ascend.caps
    assert caps.kv_block_sizes[0] == 128 and not caps.batch_invariant and caps.graph_capture  # 910B3, 2.13.0
    from deepinfer.backends.ascend.caps import ascend_caps

    assert not ascend_caps("950", True, (2, 13, 0)).graph_capture and not ascend_caps("a2", True, (2, 6, 0)).graph_capture
    why = caps.unsupported(FeatureRequest(dtype=torch.float32, batch_invariant=True, model_type="deepseek_v4"))
    assert any("float32" in r for r in why) and any("batch-invariant" in r for r in why)
    assert any("deepseek_v4" in r for r in why)


def test_hccl_communicator_code_over_a_gloo_group(ascend):
    from deepinfer.backends.ascend.communicator import HCCLCommunicator
    from deepinfer.errors import BackendError
    from deepinfer.parallel.local_ranks import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(BackendError, match="runs on 'gloo'.*needs 'hccl'"):
            HCCLCommunicator()  # on an NPU the group must be HCCL's
        comm = ascend.make_communicator(None, "tp")  # the fake's job runs on gloo
        assert isinstance(comm, HCCLCommunicator) and comm.name == "tp"
        x = torch.arange(12.0).view(4, 3)
        assert comm.world_size == 1 and torch.equal(comm.all_reduce(x), x)
        assert torch.equal(comm.all_gather(x, dim=1), x) and torch.equal(comm.broadcast(x), x)
        assert torch.equal(comm.all_to_all(x, [4], [4]), x)
        with pytest.raises(BackendError, match="src=3"):
            comm.broadcast(x, src=3)
        ascend.install_communicators({"tp": comm})
        assert ascend.communicator("tp") is comm and ascend.communicator("ep").world_size == 1
    finally:
        ascend.install_communicators({})
        dist.destroy_process_group()


class _CountingModel:
    """Stands in for a model: its output is a function of the static inputs it was handed."""

    def forward(self, batch, caches):
        return batch.input_ids.float()[:, None] * 2 + batch.positions.float()[:, None]


def test_npu_graph_runner_captures_and_replays_through_torch_npu(fake_npu):
    from deepinfer.backend import KVCaches, KVCacheSpec
    from deepinfer.backends.ascend.graph_runner import NPUGraphRunner

    events = fake_npu.npu.EVENTS
    events.clear()
    spec = KVCacheSpec("mla", (0,), (8,), torch.float16)
    caches = KVCaches.allocate([spec], {"mla": 4}, 16, 4, torch.device("cpu"))
    runner = NPUGraphRunner.capture(_CountingModel(), caches, 16, 64, 4, torch.device("cpu"), buckets=[1, 4])
    assert events.count("capture_begin") == 2 and events.count("capture_end") == 2 and events[-1] == "synchronize"
    assert runner.graphs[4][0].captured and runner.bucket_for(3) == 4
