"""Whole-model bf16 accuracy on the H200 next to transformers' own bf16 (issue 14, numerics).

The paired measure of benchmarks/accuracy_bf16.py (benchmarks/teacher_forced.py) at its preset (acc-v3-1k:
hidden 1024, kv_lora 512, 16 heads, 32 experts top-4, 5 layers, YaRN): every run reads the same token stream
(prompts + the fp32 reference's greedy tokens) and its logits at each position are compared with the fp32
reference's, in reference row standard deviations (RMS logit error) and by argmax agreement. DeepInfer's nvidia
bf16 forward, in its decode form (the absorbed decode kernels greedy decoding runs) and its prefill form, must
be no less accurate than transformers' bf16 forward on the same positions: its mean RMS error not above
transformers' by more than two paired standard errors, and its argmax agreement not below transformers' by more
than two standard deviations of the discordant-pair count (McNemar).

Why paired (history): the first version compared two independent greedy runs scored on their own streams;
after the first near-tie they read different contexts, and at 896 tokens (2026-12-03, H200) DeepInfer 736 vs
transformers 743 exact argmax and a mean gap of 0.066 vs 0.058 sigma were one standard error apart: the test
could neither pass nor fail on the implementations.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS, NEW_TOKENS, SEED = 14, 32, 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_acc_v3_1k_bf16_no_less_accurate_than_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from benchmarks.accuracy_bf16 import hf_greedy, prompts
    from benchmarks.teacher_forced import deepinfer_logits, paired, position_errors
    from deepinfer import DeepInferenceEngine, EngineConfig
    from deepinfer.checkpoints import make_checkpoint

    transformers.logging.set_verbosity_error()
    path = os.path.join(tmp_path, "acc-v3-1k")
    make_checkpoint("acc-v3-1k", path, seed=SEED)
    cfg = json.load(open(os.path.join(path, "config.json")))
    ps = prompts(cfg["vocab_size"], PROMPTS, SEED)

    engine = DeepInferenceEngine(EngineConfig(path, device="nvidia", dtype="bfloat16", load_progress=False,
                                              max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    errs: dict[str, list[dict]] = {"decode": [], "prefill": [], "hf": []}
    with torch.no_grad():
        for q in ps:
            gen = hf_greedy(ref, q, NEW_TOKENS, "cuda")
            ids, first = q + gen[:-1], len(q) - 1
            x = torch.tensor([ids], device="cuda")
            rows32 = ref(x).logits[0, first:].float()
            errs["hf"].append(position_errors(hf16(x).logits[0, first:].float(), rows32))
            for form in ("decode", "prefill"):
                errs[form].append(position_errors(deepinfer_logits(engine, ids, first, form), rows32))
    cat = {k: {m: torch.cat([e[m] for e in v]).cpu() for m in v[0]} for k, v in errs.items()}
    hf = cat["hf"]
    report = {k: {m: float(t.float().mean()) for m, t in e.items()} for k, e in cat.items()}
    for form in ("decode", "prefill"):
        di = cat[form]
        d = paired(di, hf, "rms")
        report[f"{form}_paired_rms"] = d
        assert d["mean_diff"] <= 2 * d["se"], json.dumps(report)
        discordant = int((di["agree"] != hf["agree"]).sum())
        assert int(di["agree"].sum()) >= int(hf["agree"].sum()) - 2 * discordant**0.5, json.dumps(report)
    print(json.dumps(report))
