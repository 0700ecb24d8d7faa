"""benchmarks.fp8_norm_quant's dry run: the fused RMSNorm + fp8 quant kernel and the two kernels it replaces, under
the Triton interpreter at a tiny shape, give the same bits (the benchmark's own check), and the JSON line says so."""

import json


def test_dry_run_checks_the_bits(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from benchmarks import fp8_norm_quant

    out = tmp_path / "r.jsonl"
    assert fp8_norm_quant.main(["--dry-run", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rows"] for r in rows] == [5] and rows[0]["same_bits"] is True and rows[0]["hidden"] == 256
    assert "same bits" in capsys.readouterr().out
