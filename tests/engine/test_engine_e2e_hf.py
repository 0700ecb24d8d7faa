"""End to end against Hugging Face transformers (fp32): greedy generation of a batch of prompts of
different lengths, teacher-forced: every token we chose must have a reference logit within 1e-4
of the reference row maximum at that position. Once with chunked prefill under a small token
budget, once with a KV pool so small that sequences are preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

PRESETS = ["tiny-v2-lite", "tiny-v2", "tiny-v3", "tiny-v3-fp8"]
LENGTHS = [1, 3, 6, 9, 14, 17, 23, 31, 40]  # 9 prompts, crossing the 16-token block boundary
MAX_TOKENS = 10
TOL = 1e-4


def make_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist() for n in LENGTHS]


def check_teacher_forced(hf, prompts, outputs) -> None:
    for p, o in zip(prompts, outputs):
        assert len(o.token_ids) == MAX_TOKENS and o.finish_reason == "length"
        full = p + o.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([full])).logits[0].float()
        for k, tok in enumerate(o.token_ids):
            row = logits[len(p) + k - 1]
            gap = float(row.max() - row[tok])
            assert gap <= TOL, f"prompt len {len(p)}, token {k}: chose {tok}, reference argmax {int(row.argmax())}, gap {gap:.2e}"


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_batch_matches_transformers(preset, checkpoint, hf_reference):
    path = checkpoint(preset)
    hf = hf_reference(preset)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    # chunked prefill: a 16-token budget splits the longer prompts across steps
    engine = DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=64,
                     max_num_batched_tokens=16, num_kv_blocks=64, load_progress=False)
    )
    prompts = make_prompts(engine.vocab_size)
    chunked = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats().num_preemptions == 0
    check_teacher_forced(hf, prompts, chunked)

    # preemption: 8 blocks of 16 tokens for 9 sequences of up to 50 tokens
    engine = DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=64,
                     max_num_batched_tokens=32, num_kv_blocks=8, load_progress=False)
    )
    preempted = engine.generate(prompts, params, use_tqdm=False)
    st = engine.stats()
    assert st.num_preemptions > 0, "the KV pool was meant to be too small for the batch"
    assert st.kv_blocks_used == 0
    check_teacher_forced(hf, prompts, preempted)
