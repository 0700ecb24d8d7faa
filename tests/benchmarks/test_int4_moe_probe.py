"""benchmarks.int4_moe_probe's dry run: under the Triton interpreter at a tiny shape every probe kernel's partial
sums (the byte stream's integer sum, the scaled bytes, the interleaved, planes and words dequants against one
activation row) add up to torch's reference over the same int4 weights, at each K split and unroll, and the
engine's direct GEMM runs through both its mainloops."""

import json


def test_dry_run_matches_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from benchmarks import int4_moe_probe

    out = tmp_path / "r.jsonl"
    args = ["--dry-run", "--splits", "1,2", "--block-n", "16", "--unroll", "1,2", "--json", str(out)]
    assert int4_moe_probe.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kernel"] for r in rows[:2]] == ["engine", "engine_gemv"]
    probes = rows[2:]
    assert {r["kernel"] for r in probes} == {"stream", "scaled", "dequant", "planes", "planes_nox", "words"}
    assert {(r["split"], r["unroll"]) for r in probes} >= {(1, 1), (1, 2), (2, 1)}
    assert all(r["max_err"] < 1e-5 for r in probes), probes
