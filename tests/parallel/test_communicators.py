"""The communicators: every collective over real gloo ranks against values computed here, the conformance
check over 4 ranks (and that it catches a broken communicator), the one-process checks, `deepinfer check
--world-size 2`.

Two multi-process runs (2 and 4 ranks) do most of the work; each rank function returns plain tensors /
rows and the asserts run in the test process, against expectations written from the contract
(backend/communicator.py), not from another communicator's output.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from deepinfer.backend import PROCESS_GROUP_NAMES, SingleProcessCommunicator, TorchDistributedCommunicator
from deepinfer.errors import BackendError
from deepinfer.parallel.local_ranks import free_port, run_local_ranks

# ------------------------------------------------------------------ 2 ranks: every op, values computed here


def _x(rank: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """Rank r's input: distinct on every rank and element, known to every process."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).view(*shape) + 100 * rank).to(dtype)


def _bf16(rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).bfloat16()


def _uneven_splits(rank: int) -> tuple[list[int], list[int]]:
    """rank 0 sends [0, 3] (nothing to itself), rank 1 sends [2, 1]: each receives what the other sends it."""
    sends = {0: [0, 3], 1: [2, 1]}
    return sends[rank], [sends[j][rank] for j in (0, 1)]


def _two_rank_checks(rank: int, world: int) -> dict:
    from deepinfer.backends.cpu.backend import CPUBackend

    comm = CPUBackend().make_communicator(dist.group.WORLD, "tp")
    out: dict = {"rank": comm.rank, "world": comm.world_size, "transport": comm.transport}
    x = _x(rank, 3, 4)
    out["all_reduce"] = comm.all_reduce(x)
    out["input_untouched"] = torch.equal(x, _x(rank, 3, 4))
    out["all_reduce_bf16"] = comm.all_reduce(_bf16(rank))
    out["all_gather_0"] = comm.all_gather(x, dim=0)
    out["all_gather_-1"] = comm.all_gather(x, dim=-1)
    out["reduce_scatter_1"] = comm.reduce_scatter(x, dim=1)
    native = TorchDistributedCommunicator(dist.group.WORLD, "tp", reduce_scatter="native")  # NCCL / HCCL's path
    out["reduce_scatter_1_native"] = native.reduce_scatter(x, dim=1)
    ins, outs = _uneven_splits(rank)
    a2a_in = _x(rank, sum(ins), 2)
    out["all_to_all"] = comm.all_to_all(a2a_in, ins, outs)
    out["all_to_all_exchanged"] = comm.all_to_all(a2a_in, ins)  # output_splits learned from the other rank
    out["broadcast_1"] = comm.broadcast(_x(rank, 2, 3), src=1)
    fp8 = _x(rank, 2, 3).div(64).to(torch.float8_e4m3fn)  # gloo has no float8 kernels: moved as bytes
    out["all_gather_fp8"] = comm.all_gather(fp8, dim=-1).view(torch.uint8)
    out["all_to_all_fp8"] = comm.all_to_all(fp8).view(torch.uint8)
    errors = {}
    for name, call in {
        "input_splits sum": lambda: comm.all_to_all(_x(rank, 4, 2), [1, 2], [2, 2]),
        "output_splits length": lambda: comm.all_to_all(_x(rank, 4, 2), [2, 2], [2, 2, 0]),
        "input_splits None, odd rows": lambda: comm.all_to_all(_x(rank, 5, 2)),
        "reduce_scatter dim": lambda: comm.reduce_scatter(_x(rank, 3, 4), dim=0),
        "broadcast src": lambda: comm.broadcast(x, src=2),
    }.items():
        try:
            call()
            errors[name] = None
        except BackendError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    out["after_errors"] = comm.all_reduce(torch.ones(2))  # still in step: nothing was sent by the bad calls
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_local_ranks(_two_rank_checks, 2, timeout_s=120)


def test_two_gloo_ranks_every_op_gives_the_contract_values(two_ranks):
    x0, x1 = _x(0, 3, 4), _x(1, 3, 4)
    for r, out in enumerate(two_ranks):
        assert (out["rank"], out["world"], out["transport"]) == (r, 2, "gloo")
        assert out["input_untouched"]
        assert torch.equal(out["all_reduce"], x0 + x1)
        assert torch.equal(out["all_gather_0"], torch.cat([x0, x1], 0))
        assert torch.equal(out["all_gather_-1"], torch.cat([x0, x1], 1))
        assert out["all_gather_-1"].shape == (3, 8)
        assert torch.equal(out["reduce_scatter_1"], (x0 + x1)[:, 2 * r: 2 * r + 2])
        assert torch.equal(out["reduce_scatter_1_native"], (x0 + x1)[:, 2 * r: 2 * r + 2])
        assert torch.equal(out["broadcast_1"], _x(1, 2, 3))
        fp8 = [_x(j, 2, 3).div(64).to(torch.float8_e4m3fn).view(torch.uint8) for j in (0, 1)]
        assert torch.equal(out["all_gather_fp8"], torch.cat(fp8, -1))
        assert torch.equal(out["all_to_all_fp8"], torch.cat([fp8[0][r:r + 1], fp8[1][r:r + 1]]))
        # uneven all_to_all: rank 0 gets rank 1's first 2 rows; rank 1 gets rank 0's 3 rows then its own last row
        sent = {j: _x(j, sum(_uneven_splits(j)[0]), 2).split(_uneven_splits(j)[0]) for j in (0, 1)}
        want = torch.cat([sent[0][r], sent[1][r]])
        assert want.shape[0] == (2 if r == 0 else 4)
        assert torch.equal(out["all_to_all"], want) and torch.equal(out["all_to_all_exchanged"], want)
        assert torch.equal(out["after_errors"], torch.full((2,), 2.0))


def test_two_gloo_ranks_bf16_all_reduce(two_ranks):
    a, b = _bf16(0), _bf16(1)
    s0, s1 = two_ranks[0]["all_reduce_bf16"], two_ranks[1]["all_reduce_bf16"]
    assert s0.dtype == torch.bfloat16 and torch.equal(s0, s1)  # the same bits on both ranks
    assert torch.equal(s0, (a.float() + b.float()).bfloat16())  # two terms: one rounding of the exact sum


def test_two_gloo_ranks_bad_arguments_raise_on_every_rank_naming_them(two_ranks):
    named = {"input_splits sum": "input_splits=", "output_splits length": "output_splits=",
             "input_splits None, odd rows": "input_splits=None", "reduce_scatter dim": "dim=0",
             "broadcast src": "src=2"}
    for out in two_ranks:
        for case, arg in named.items():
            assert out["errors"][case] is not None and arg in out["errors"][case], (case, out["errors"][case])


# ------------------------------------------------------------------ 4 ranks: the conformance check, subgroups


class ReversedGather(TorchDistributedCommunicator):
    """A deliberately wrong communicator: all_gather in reverse rank order."""

    def all_gather(self, x, dim=0):
        out = super().all_gather(x, dim)
        return torch.cat(list(reversed(out.chunk(self.world_size, dim))), dim)


def _four_rank_checks(rank: int, world: int) -> dict:
    from deepinfer.conformance.collectives import collective_rank_main, run_cases_on

    rows = collective_rank_main(rank, world, "cpu", 0, ["float32", "bfloat16"])
    broken = run_cases_on(ReversedGather(dist.group.WORLD, "broken"), "TP=4", "tp", list(range(world)), 0,
                          [torch.float32], torch.device("cpu"), ops=["all_gather", "all_reduce"])
    return {"rows": rows, "broken": broken}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_local_ranks(_four_rank_checks, 4, timeout_s=180)


def test_four_gloo_ranks_pass_the_collectives_check_on_every_group(four_ranks):
    from deepinfer.conformance.collectives import CollectiveReport, check_same_on_every_rank

    report = CollectiveReport("cpu", 4, 0, [row for r in four_ranks for row in r["rows"]])
    check_same_on_every_rank(report.rows)
    assert report.ok, report.format_table()
    tally = report.per_rank()
    assert len({c["pass"] for c in tally.values()}) == 1 and tally[0]["pass"] > 50
    groups = {(row.layout, row.group, row.ranks) for row in report.rows}
    # the world as one group, and TP=2 x DP=2: tp groups {0,1}, {2,3}; dp groups {0,2}, {1,3}
    assert groups == {("TP=4 x DP=1", "tp", (0, 1, 2, 3)), ("TP=2 x DP=2", "tp", (0, 1)),
                      ("TP=2 x DP=2", "tp", (2, 3)), ("TP=2 x DP=2", "dp", (0, 2)), ("TP=2 x DP=2", "dp", (1, 3))}
    ops = {row.op for row in report.rows}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    # broadcast from group rank 1 of a dp group: global rank 2 or 3 (the group rank was mapped)
    assert any(r.group == "dp" and r.op == "broadcast" and "group rank 1" in r.case for r in report.rows)
    assert any("zero-size" in r.case and r.dtype == "bfloat16" for r in report.rows)


def test_the_collectives_check_fails_a_wrong_all_gather(four_ranks):
    rows = [row for r in four_ranks for row in r["broken"]]
    failed = {(row.op, row.case) for row in rows if row.status != "pass"}
    assert failed and all(op == "all_gather" for op, _ in failed)
    assert all(row.status == "pass" for row in rows if row.op == "all_reduce")
    assert all("not bit-exact" in row.reason for row in rows if row.status == "fail")


# ------------------------------------------------------------------ one process


def test_single_process_communicator_is_the_checked_identity():
    comm = SingleProcessCommunicator()
    x = torch.arange(6.0).view(3, 2)
    assert comm.all_reduce(x) is x and comm.all_gather(x, -1) is x and comm.reduce_scatter(x, 1) is x
    assert comm.all_to_all(x) is x and comm.all_to_all(x, [3], [3]) is x and comm.broadcast(x, 0) is x
    for call, arg in [(lambda: comm.all_to_all(x, [2], [3]), "input_splits="),
                      (lambda: comm.all_to_all(x, [3], [2, 1]), "output_splits="),
                      (lambda: comm.all_to_all(x, [-3]), "input_splits="),
                      (lambda: comm.broadcast(x, src=1), "src=1"),
                      (lambda: comm.all_gather(x, dim=2), "dim=2"),
                      (lambda: comm.reduce_scatter(x, dim=-3), "dim=-3")]:
        with pytest.raises(BackendError, match=arg):
            call()


def test_backend_communicator_groups_are_checked():
    from deepinfer.backends.cpu.backend import CPUBackend

    backend = CPUBackend()
    assert PROCESS_GROUP_NAMES == ("tp", "dp", "ep")
    assert all(backend.communicator(g).world_size == 1 for g in PROCESS_GROUP_NAMES)
    with pytest.raises(ValueError, match="'pp'"):
        backend.communicator("pp")
    with pytest.raises(ValueError, match="unknown communicator groups"):
        backend.install_communicators({"sp": SingleProcessCommunicator()})
    with pytest.raises(TypeError, match="tp"):
        backend.install_communicators({"tp": object()})
    mine = SingleProcessCommunicator()
    backend.install_communicators({"ep": mine})
    assert backend.communicator("ep") is mine and backend.communicator("tp") is not mine
    assert backend.caps.max_tensor_parallel_size > 1  # gloo spans any number of CPU processes


def test_torch_distributed_communicator_needs_init_and_the_right_transport():
    with pytest.raises(BackendError, match="not initialized"):
        TorchDistributedCommunicator(None, "tp")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(BackendError, match="runs on 'gloo'.*needs 'nccl'"):
            TorchDistributedCommunicator(None, "tp", expect_transport="nccl")
        comm = TorchDistributedCommunicator(None, "tp")
        x = torch.ones(2, 3)
        assert comm.all_reduce(x) is x and comm.all_to_all(x, [2]) is x
        with pytest.raises(BackendError, match="output_splits"):
            comm.all_to_all(x, [2], [1])
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the CLI


def test_deepinfer_check_world_size_2_reports_every_rank(capsys):
    from deepinfer.entrypoints.cli import main

    rc = main(["check", "--device", "cpu", "--world-size", "2", "--dtype", "float32", "--json",
               "--op", "all_to_all", "--op", "broadcast"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"] and report["world_size"] == 2
    assert set(report["per_rank"]) == {"0", "1"} and all(c["fail"] == c["error"] == 0 and c["pass"] > 5
                                                         for c in report["per_rank"].values())
    assert {row["op"] for row in report["rows"]} == {"all_to_all", "broadcast"}
    assert main(["check", "--device", "cpu", "--world-size", "2", "--op", "rms_norm"]) == 2
    assert "collectives only" in capsys.readouterr().err
