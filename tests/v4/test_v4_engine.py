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


def _engine(path: str, max_model_len: int = 96, **kw) -> DeepInferenceEngine:
    return DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=max_model_len,
                     load_progress=False, **kw)
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


def test_engine_blocks_per_group_follow_the_formulas(tiny_dir):
    """One request: compressed groups hold ceil(entries / block_size) blocks (entries = tokens // m);
    the sliding group never holds more than a window plus the step's chunk."""
    engine = _engine(tiny_dir, max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=256)
    bs = engine.stats().kv_capacity_tokens // 256
    prompt = torch.randint(2, 1024, (150,), generator=torch.Generator().manual_seed(9)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    cached, steps = 0, 0  # tokens in the cache after each step: 32-token chunks, then one per decode step
    while engine.has_unfinished_requests():
        outs = engine.step()
        cached = min(cached + 32, 150) if cached < 150 else cached + 1
        if outs and outs[0].finished:
            break
        steps += 1
        used = {g: u for g, (u, _) in engine.stats().kv_blocks_by_group.items()}
        assert used["v4_csa"] == used["v4_idx"] == -(-(cached // 4) // bs)
        assert used["v4_hca"] == -(-(cached // 16) // bs)
        assert 1 <= used["v4_swa"] <= -(-(8 + 32) // bs) + 1
        assert engine.stats().num_state_slots_used == 1
    assert steps == 5 + 18 and cached == 150 + 19
    assert engine.stats().kv_blocks_used == 0 and engine.stats().num_state_slots_used == 0
