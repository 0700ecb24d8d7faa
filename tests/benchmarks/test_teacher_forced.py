"""benchmarks/teacher_forced.py, the paired accuracy measure: its two forms of DeepInfer's forward on one token
stream must be the model (fp32: both equal transformers' fp32 logits), and its error summaries must be right on
hand-made rows. If the decode form mis-built its rows (wrong positions, slots or block tables), its logits would
leave the reference at once."""

from __future__ import annotations

import pytest
import torch

from benchmarks.teacher_forced import deepinfer_logits, paired, position_errors


def test_position_errors_hand_made():
    ref = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 0.0]])
    same = position_errors(ref.clone(), ref)
    assert same["agree"].all() and same["gap"].abs().max() == 0 and same["rms"].abs().max() == 0
    assert same["kl"].abs().max() < 1e-6
    off = ref.clone()
    off[0, 1] = 9.0  # row 0's argmax moves to token 1, whose reference logit is 2 below the maximum
    e = position_errors(off, ref)
    assert e["agree"].tolist() == [False, True]
    assert torch.allclose(e["gap"][0], 2.0 / ref[0].std())
    assert e["gap"][1] == 0 and e["kl"][0] > 0.5
    d = paired(e, same, "gap")
    assert d["mean_diff"] == pytest.approx(float(e["gap"].mean()))


def test_forms_equal_the_fp32_reference(checkpoint):
    transformers = pytest.importorskip("transformers")
    from deepinfer import DeepInferenceEngine, EngineConfig

    transformers.logging.set_verbosity_error()
    path = checkpoint("tiny-v3")
    engine = DeepInferenceEngine(EngineConfig(path, device="cpu", dtype="float32", max_model_len=128,
                                              num_kv_blocks=32, enable_prefix_caching=False, load_progress=False))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    ids = [0] + torch.randint(2, 200, (40,), generator=g).tolist()
    first = 9
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, first:].float()
    for form in ("prefill", "decode"):
        got = deepinfer_logits(engine, ids, first, form)
        assert got.shape == want.shape, form
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=form)
    with pytest.raises(ValueError, match="form"):
        deepinfer_logits(engine, ids, first, "verify")
