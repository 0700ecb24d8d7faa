"""tiny-v4 with fp8 e4m3 128x128 block-quantized linears (as V4 releases ship attention / expert weights).

Our model loads the fp8 tensors with their weight_scale_inv; the reference loads the same
weights dequantized (q * scale) into fp32. Logits must agree.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from v4_helpers import hf_logits, load_hf, load_ours, run_chunks, write_fp8_pair


def test_fp8_block_linears_match_dequantized_reference(tmp_path):
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    tensors = write_fp8_pair(str(fp8_dir), str(ref_dir))
    assert sum(t.dtype == torch.float8_e4m3fn for t in tensors.values()) > 50

    ours = load_ours(str(fp8_dir))
    assert ours.quantization == "fp8_block"
    hf = load_hf(str(ref_dir))
    ids = torch.randint(2, 1024, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(run_chunks(ours, ids, [5, 7]), ref, atol=2e-5, rtol=0)

    # DeepSeek's own naming of the block scales: `<linear>.scale`
    renamed = {(n[: -len("weight_scale_inv")] + "scale" if n.endswith("weight_scale_inv") else n): t
               for n, t in tensors.items()}
    save_file(renamed, os.path.join(fp8_dir, "model.safetensors"))
    torch.testing.assert_close(run_chunks(load_ours(str(fp8_dir)), ids, [37]), ref, atol=2e-5, rtol=0)
