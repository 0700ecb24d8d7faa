"""The MLA decode kernel over an fp8 KV cache compiles for sm_90 (no GPU needed: Triton's own ptxas), its dots in
bf16 and in fp16, at V2-Lite's batch-1 and batch-256 launches (mla_sm90_compile.py, in a subprocess without
TRITON_INTERPRET). Recorded on 2026-12-04 (Triton 3.9 on the CPU): the bf16-dot kernel already spills at batch 256
(168 bytes of stack at 255 registers; docs/quantization.md "fp8 KV cache"); the fp16 dots must not add more than
a few bytes to it."""

from __future__ import annotations

from pathlib import Path

from sm90_compile_run import needs_ptxas, run_compile_script


@needs_ptxas
def test_mla_decode_fp8_cache_compiles_for_sm90_in_both_dot_dtypes():
    found, out = run_compile_script(Path(__file__).with_name("mla_sm90_compile.py"))
    rows = {r["kernel"]: r for r in found}
    assert len(rows) == 4, out
    for launch in ("b1", "b256"):
        bf16, fp16 = (rows[f"mla_decode fp8 cache, {dot} dots, {launch}"] for dot in ("bf16", "fp16"))
        assert fp16["stack"] <= bf16["stack"] + 16, (bf16, fp16)
