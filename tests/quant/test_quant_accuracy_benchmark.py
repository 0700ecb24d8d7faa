"""benchmarks/quant_accuracy.py in its dry mode: the rows it promises, in the ranges they must have.

The full run's numbers live in docs/quantization.md ("Accuracy"); this only keeps the benchmark working: every
row present with its measures, agreements and margins in range, the reference's rerun agreeing with it exactly
(a forward that is not deterministic, or a tally comparing the wrong windows, fails it), and each quantized
row actually running its scheme (the benchmark refuses a model whose linears run another)."""

from __future__ import annotations

import json
import math

from benchmarks.quant_accuracy import DRY_SCHEMES, Tally, main

KEYS = ("tokens", "top1_agreement", "disagreements", "min_window_agreement", "mean_abs_logprob_gap",
        "max_abs_logprob_gap", "mean_nll", "perplexity", "perplexity_vs_reference", "mean_kl", "linears")


def test_dry_run_structure_and_ranges(tmp_path, capsys):
    out_file = tmp_path / "acc.json"
    assert main(["--dry-run", "--json-out", str(out_file)]) == 0
    out = json.loads(out_file.read_text())
    rows = {r["scheme"]: r for r in out["results"]}
    assert tuple(rows) == DRY_SCHEMES
    assert out["data"]["held_out_files"] > 0 and len(out["data"]["window_indices"]) == 2
    for name, r in rows.items():
        for k in KEYS:
            assert k in r, f"{name}: {k} missing"
        assert r["tokens"] == 2 * 32
        assert 0.0 <= r["top1_agreement"] <= 1.0 and 0.0 <= r["min_window_agreement"] <= 1.0
        assert r["disagreements"] == round(r["tokens"] * (1 - r["top1_agreement"]))
        assert 0.0 <= r["mean_abs_logprob_gap"] <= r["max_abs_logprob_gap"] + 1e-12
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1.0
        assert r["mean_kl"] >= -1e-6
    ref, rerun = rows["reference"], rows["none (rerun)"]
    assert ref["top1_agreement"] == 1.0 and rerun["top1_agreement"] == 1.0
    assert rerun["max_abs_logprob_gap"] == 0.0 and rerun["perplexity"] == ref["perplexity"]
    assert ref["linears"] == {"none": sum(ref["linears"].values())}
    assert all(r["lm_head"] == "none" for r in rows.values())  # no dry row quantizes the head
    for name in ("fp8_w8a8", "int4_awq", "int8_w8a8"):
        assert set(rows[name]["linears"]) == {name}
        assert rows[name]["max_abs_logprob_gap"] > 0.0, f"{name} gave the reference's logprobs: nothing was quantized"
    assert rows["int4_awq"]["stayed_dense"] == []  # every linear of stdlib-coder has K % 128 == 0
    printed = capsys.readouterr().out
    assert sum(1 for line in printed.splitlines() if line.startswith('{"bench": "quant_accuracy"')) == len(DRY_SCHEMES)


def test_tally_on_known_rows():
    import torch

    ref = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), -1)
    other = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0]]), -1)  # row 0 flips the argmax
    t = Tally()
    t.add(other, ref, torch.tensor([0, 1]))
    s = t.summary()
    assert s["top1_agreement"] == 0.5 and s["disagreements"] == 1
    gap0 = abs(float(other[0, 0] - ref[0, 0]))
    assert math.isclose(s["max_abs_logprob_gap"], gap0, rel_tol=1e-6)
    assert math.isclose(s["mean_abs_logprob_gap"], gap0 / 2, rel_tol=1e-6)
    assert math.isclose(s["median_ref_margin_at_disagreement"], 1.0, rel_tol=1e-6)  # 2.0 - 1.0 in logprob
    assert math.isclose(s["mean_nll"], -float(other[0, 0] + other[1, 1]) / 2, rel_tol=1e-6)
