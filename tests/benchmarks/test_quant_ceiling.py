"""benchmarks.quant_summary's prefill ceiling (Amdahl's bound from the two runs' device profiles) and
benchmarks.profile_region's kernel classes, on kernel names from the GPU logs (docs/perf-log)."""

import json

import pytest

from benchmarks.profile_region import kernel_class
from benchmarks.quant_summary import main, prefill_ceiling


@pytest.mark.parametrize("name,cls", [
    ("_aligned_gemm_kernel", "moe_gemm"), ("_direct_gemm_kernel", "moe_gemm"),
    ("nvjet_qqtst_128x128_64x4_2x1_v_bz_coopB_NNN", "dense_gemm"), ("_fp8_gemm_kernel", "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "dense_gemm"),
    ("_act_quant_kernel", "act_quant"), ("_rms_norm_fp8_kernel", "act_quant"), ("_silu_mul_quant_kernel", "act_quant"),
    ("_prefill_kernel", "attention"), ("_mla_decode_split_kernel", "attention"), ("_mla_prep_kernel", "attention"),
    ("_combine_kernel", "other"), ("_rms_norm_kernel", "other"), ("_moe_align_kernel", "other"),
])
def test_kernel_classes(name, cls):
    assert kernel_class(name) == cls


def _profile(kernel_sum, classes):
    return {"wall_ms": kernel_sum * 1.1, "device_busy_ms": kernel_sum, "kernel_sum_ms": kernel_sum,
            "classes_ms": classes}


def test_ceiling_is_amdahls_bound():
    base = _profile(100.0, {"moe_gemm": 40.0, "dense_gemm": 20.0, "attention": 15.0, "other": 25.0})
    quant = _profile(80.0, {"moe_gemm": 25.0, "dense_gemm": 15.0, "act_quant": 4.0, "attention": 15.0, "other": 21.0})
    c = prefill_ceiling(base, quant)
    assert c["kernel_ratio"] == pytest.approx(1.25) and c["gemm_ratio"] == pytest.approx(1.5)
    # the quantized run's 40 ms of non-GEMM kernels stay; its GEMMs at half the base's 60 ms
    assert c["ceiling"] == pytest.approx(100 / 70) and c["ceiling_free_quant"] == pytest.approx(100 / 66)
    assert c["rest_ms"] == {"base": pytest.approx(40.0), "quant": pytest.approx(40.0)}


def test_main_prints_the_ceiling_from_json_out_files(tmp_path, capsys):
    def write(path, tok_s, profile):
        rows = [{"bench": "throughput", "quant_summary": {"linears": {}}},
                {"bench": "prefill", "prefill_tok_s": tok_s, "profile": profile}]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return str(path)

    base = write(tmp_path / "b.jsonl", 1000.0, _profile(100.0, {"moe_gemm": 60.0, "other": 40.0}))
    quant = write(tmp_path / "q.jsonl", 1200.0, _profile(80.0, {"moe_gemm": 40.0, "other": 40.0}))
    assert main([base, quant]) == 0
    out = capsys.readouterr().out
    assert "1.20" in out and "Ceiling with the quantized GEMMs at 2x the base's and the rest as measured: 1.429x" in out
