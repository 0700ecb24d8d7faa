"""tiny-v4 through the engine (scheduler, multi-group KV manager, model runner) against transformers.

Greedy generation of a batch of prompts of different lengths, teacher-forced:
each chosen token must have a reference logit within 1e-4 of the reference
row maximum. Once with chunked prefill under a small token budget (chunks
land at every phase of W=8, m=4, m=16), once with a pool so small that
sequences are preempted and recomputed.
"""

from __future__ import annotations

import torch

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

LENGTHS = [1, 3, 5, 8, 9, 16, 17, 33, 47]
MAX_TOKENS = 12
TOL = 1e-4


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[0] + torch.randint(2, 1024, (n - 1,), generator=g).tolist() for n in LENGTHS]


def _check_teacher_forced(hf, prompts, outputs) -> None:
    for p, o in zip(prompts, outputs):
        assert len(o.token_ids) == MAX_TOKENS and o.finish_reason == "length"
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.token_ids])).logits[0].float()
        for k, tok in enumerate(o.token_ids):
            row = logits[len(p) + k - 1]
            gap = float(row.max() - row[tok])
            assert gap <= TOL, f"prompt len {len(p)}, token {k}: chose {tok}, reference argmax {int(row.argmax())}"


def _engine(path: str, **kw) -> DeepInferenceEngine:
    return DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=96, load_progress=False, **kw)
    )


def test_engine_greedy_mixed_batch_chunked_prefill(tiny_dir, hf_model):
    engine = _engine(tiny_dir, max_num_batched_tokens=13, num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    outs = engine.generate(prompts, params, use_tqdm=False)
    st = engine.stats()
    assert st.num_preemptions == 0
    assert st.kv_blocks_used == 0
    assert set(st.kv_blocks_by_group) == {"v4_swa", "v4_csa", "v4_idx", "v4_hca"}
    _check_teacher_forced(hf_model, prompts, outs)


def test_engine_tiny_pool_preempts_and_gives_the_same_tokens(tiny_dir, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    roomy = _engine(tiny_dir, max_num_batched_tokens=32, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    engine = _engine(tiny_dir, max_num_batched_tokens=32, num_kv_blocks=6)
    tight = engine.generate(prompts, params, use_tqdm=False)
    st = engine.stats()
    assert st.num_preemptions > 0, "the KV pool was meant to be too small for the batch"
    assert st.kv_blocks_used == 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    _check_teacher_forced(hf_model, prompts, tight)
