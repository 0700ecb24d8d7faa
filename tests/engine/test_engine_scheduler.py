"""Scheduler + model runner + KV manager through the engine, on the arithmetic fake model.

The fake model reads every token back through the block tables (engine_fakes.py), so a
wrong slot, a block freed too early or a state row not kept makes the tokens differ from
`reference_next`; these tests are for scheduling logic, the real model math is checked
against transformers in test_engine_e2e_hf.py.
"""

from __future__ import annotations

import pytest
from engine_fakes import FakeBackend, FakeCausalLM, reference_next

from deepinfer import EngineConfig, SamplingParams
from deepinfer.engine import DeepInferenceEngine
from deepinfer.errors import ConfigError, DeepInferError, InvalidRequestError, PromptTooLongError
from deepinfer.text.tokenizer import Tokenizer

BS = 4


def make_engine(tok_dir, model, **kw) -> DeepInferenceEngine:
    cfg = EngineConfig(model_name_or_path="fake-model", **kw)
    return DeepInferenceEngine.from_components(cfg, model, Tokenizer.from_pretrained(tok_dir), FakeBackend(BS))


def prompts_of(lengths):
    return [[(7 * i + 3 * j + 2) % 250 + 5 for j in range(n)] for i, n in enumerate(lengths)]


def expected(prompt, max_tokens, model, max_model_len=10**9):
    toks = list(prompt)
    out = []
    while len(out) < max_tokens and len(toks) < max_model_len:
        t = reference_next(toks, model.window, model.m)
        out.append(t)
        toks.append(t)
    return out


GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "window,m", [(None, None), (5, None), (None, 3), (6, 4)], ids=["full", "swa", "compressed+state", "hybrid"]
)
def test_chunked_prefill_and_decode_match_reference(fake_tokenizer_dir, window, m):
    model = FakeCausalLM(window=window, m=m)
    engine = make_engine(fake_tokenizer_dir, model, max_num_batched_tokens=7, max_model_len=128, num_kv_blocks=200)
    prompts = prompts_of([1, 2, 5, 9, 13, 17, 23, 4])
    outs = engine.generate(prompts, SamplingParams(max_tokens=11, **GREEDY), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == expected(p, 11, model)
        assert o.finish_reason == "length"
    # the token budget held every step, and long prompts really were split
    assert all(sum(c) <= 7 for c in model.calls)
    assert any(len(c) > 1 and max(c) > 1 and 1 in c for c in model.calls)  # decodes mixed with a chunk
    st = engine.stats()
    assert st.kv_blocks_used == 0 and st.num_state_slots_used == 0 and st.num_running == st.num_waiting == 0
    assert st.generation_tokens_total == 8 * 11 and st.prompt_tokens_total == sum(map(len, prompts))


def test_decodes_are_scheduled_before_prefill_chunks(fake_tokenizer_dir):
    model = FakeCausalLM()
    engine = make_engine(fake_tokenizer_dir, model, max_num_batched_tokens=6, max_model_len=128, num_kv_blocks=100)
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=20, **GREEDY))
    engine.step()  # a prefills and samples
    engine.add_request("b", list(range(10, 40)), SamplingParams(max_tokens=2, **GREEDY))
    model.calls.clear()
    for _ in range(4):
        engine.step()
    # every step: a's decode (1 token) first, then 5 tokens of b's prompt
    assert model.calls[:4] == [[1, 5]] * 4


def test_preemption_recomputes_and_finishes_correctly(fake_tokenizer_dir):
    model = FakeCausalLM(window=6, m=3)
    # 12 blocks of 4 tokens: not enough for 6 sequences of up to 36 tokens at once
    engine = make_engine(
        fake_tokenizer_dir, model, max_num_batched_tokens=16, max_model_len=48, num_kv_blocks=12, max_num_seqs=6
    )
    prompts = prompts_of([3, 7, 11, 5, 9, 14])
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    st = engine.stats()
    assert st.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == expected(p, 20, model)
    assert st.kv_blocks_used == 0 and st.num_state_slots_used == 0


def test_preempted_seeded_sampling_gives_the_same_tokens(fake_tokenizer_dir):
    """Sampled requests keep their tokens across preemption: the draw is keyed by (seed, position)."""
    prompts = prompts_of([3, 7, 11, 5, 9, 14])
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    big = make_engine(fake_tokenizer_dir, FakeCausalLM(), max_model_len=48, num_kv_blocks=200, max_num_seqs=6)
    small = make_engine(fake_tokenizer_dir, FakeCausalLM(), max_model_len=48, num_kv_blocks=12, max_num_seqs=6)
    a = big.generate(prompts, params, use_tqdm=False)
    b = small.generate(prompts, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0 and big.stats().num_preemptions == 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_no_chunked_prefill_schedules_whole_prompts(fake_tokenizer_dir):
    model = FakeCausalLM(window=5)
    engine = make_engine(
        fake_tokenizer_dir, model, enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32,
        num_kv_blocks=40,
    )
    prompts = prompts_of([20, 17, 3])
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected(p, 6, model) for p in prompts]
    assert [20] in model.calls or any(20 in c for c in model.calls)  # 20 tokens in one step
    with pytest.raises(ConfigError, match="max_num_batched_tokens=16 is below max_model_len=32"):
        make_engine(fake_tokenizer_dir, model, enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=32)


def test_max_num_seqs_limits_the_running_batch(fake_tokenizer_dir):
    model = FakeCausalLM()
    engine = make_engine(fake_tokenizer_dir, model, max_num_seqs=2, max_model_len=64, num_kv_blocks=100)
    prompts = prompts_of([3, 4, 5, 6, 7])
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert all(len(c) <= 2 for c in model.calls)
    assert [o.token_ids for o in outs] == [expected(p, 5, model) for p in prompts]


def test_max_model_len_stops_with_length_and_rejects_long_prompts(fake_tokenizer_dir):
    model = FakeCausalLM()
    engine = make_engine(fake_tokenizer_dir, model, max_model_len=20, num_kv_blocks=50)
    p = prompts_of([15])[0]
    (o,) = engine.generate([p], SamplingParams(max_tokens=100, **GREEDY), use_tqdm=False)
    assert o.finish_reason == "length" and len(o.token_ids) == 5
    assert o.token_ids == expected(p, 100, model, max_model_len=20)
    with pytest.raises(PromptTooLongError, match="prompt has 20 tokens but max_model_len is 20"):
        engine.generate([list(range(5, 25))], use_tqdm=False)
    with pytest.raises(PromptTooLongError):
        engine.add_request("x", list(range(5, 30)), SamplingParams())
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks_at_once(fake_tokenizer_dir):
    model = FakeCausalLM(window=5, m=3)
    engine = make_engine(fake_tokenizer_dir, model, max_model_len=64, num_kv_blocks=100)
    engine.add_request("a", prompts_of([9])[0], SamplingParams(max_tokens=30, **GREEDY))
    engine.add_request("b", prompts_of([12])[0], SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(3):
        outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"} and not any(o.finished for o in outs)
    used = engine.stats().kv_blocks_used
    last = engine.abort_request("a")
    assert last.finished and last.finish_reason == "abort" and len(last.token_ids) == 3
    st = engine.stats()
    assert 0 < st.kv_blocks_used < used and st.num_state_slots_used == 1 and st.num_running == 1
    engine.abort_request("b")
    assert engine.abort_request("unknown") is None  # ignored
    st = engine.stats()
    assert st.kv_blocks_used == 0 and st.num_state_slots_used == 0 and not engine.has_unfinished_requests()
    assert engine.step() == []


def test_streaming_outputs_are_cumulative_and_finish_once(fake_tokenizer_dir):
    model = FakeCausalLM()
    engine = make_engine(fake_tokenizer_dir, model, max_model_len=64, num_kv_blocks=100, max_num_batched_tokens=4)
    p = prompts_of([10])[0]
    engine.add_request("r", p, SamplingParams(max_tokens=4, **GREEDY))
    seen = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.append((list(o.token_ids), o.finished))
    exp = expected(p, 4, model)
    assert seen == [(exp[:k], k == 4) for k in range(1, 5)]  # no output for mid-prompt chunks
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", p, SamplingParams())
        engine.add_request("dup", p, SamplingParams())
    with pytest.raises(DeepInferError, match="generate\\(\\) cannot run while 1 requests from add_request"):
        engine.generate([p], use_tqdm=False)
    engine.abort_request("dup")
    assert engine.generate([p], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0].token_ids == exp[:2]


def test_n_sequences_have_their_own_seeds_and_blocks(fake_tokenizer_dir):
    model = FakeCausalLM()
    engine = make_engine(fake_tokenizer_dir, model, max_model_len=64, num_kv_blocks=100)
    p = prompts_of([6])[0]
    (o,) = engine.generate([p], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True), use_tqdm=False)
    assert [c.index for c in o.outputs] == [0, 1, 2]
    # the fake model's logits are one-hot * 10, so even at T=1 most draws are its argmax;
    # sequences only need to be well-formed and independent of batch (same again with a different batch)
    (o2,) = engine.generate([p], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in o.outputs] == [c.token_ids for c in o2.outputs]
    assert all(len(c.token_ids) == 8 for c in o.outputs)
    (g,) = engine.generate([p], SamplingParams(n=2, max_tokens=8, **GREEDY), use_tqdm=False)
    assert g.outputs[0].token_ids == g.outputs[1].token_ids == expected(p, 8, model)
    assert engine.stats().kv_blocks_used == 0


class MemoryReportingBackend(FakeBackend):
    """A device that reports memory (like a GPU): the KV cache is sized from what is left."""

    name = "fake-gpu"

    def __init__(self, free: int, total: int):
        super().__init__(BS)
        from deepinfer.backend import BackendCaps

        self.caps = BackendCaps(device_type="fakegpu", dtypes=(__import__("torch").float32,), kv_block_sizes=(BS,))
        self._mem = (free, total)

    def memory_info(self):
        return self._mem

    def synchronize(self):
        return None


def test_kv_cache_sized_from_device_memory_after_a_profile_forward(fake_tokenizer_dir):
    from deepinfer.errors import BackendError

    model = FakeCausalLM(window=5, m=3)
    total, free = 2_000_000, 1_030_000  # 30 kB for the KV cache: below what 256 x 40 tokens would take
    cfg = EngineConfig(model_name_or_path="fake-model", max_model_len=40, max_num_batched_tokens=100,
                       gpu_memory_utilization=0.5)
    engine = DeepInferenceEngine.from_components(
        cfg, model, Tokenizer.from_pretrained(fake_tokenizer_dir), MemoryReportingBackend(free, total)
    )
    # the profile forward ran the whole token budget, in sequences no longer than max_model_len
    assert model.calls[0] == [40, 40, 20]
    budget = free - 0.5 * total  # 0.5 of the device, less what is already in use
    assert engine.kv_plan.bytes_total <= budget and engine.kv_plan.bytes_total > 0.9 * budget
    (o,) = engine.generate([prompts_of([9])[0]], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert o.token_ids == expected(prompts_of([9])[0], 5, model)
    with pytest.raises(BackendError, match="no device memory left for the KV cache"):
        DeepInferenceEngine.from_components(
            cfg, FakeCausalLM(), Tokenizer.from_pretrained(fake_tokenizer_dir), MemoryReportingBackend(900_000, total)
        )


def test_running_set_never_exceeds_the_token_budget(fake_tokenizer_dir):
    """With a 3-token budget at most 3 sequences run, so each running sequence decodes every step."""
    model = FakeCausalLM()
    engine = make_engine(fake_tokenizer_dir, model, max_num_batched_tokens=3, max_model_len=64, num_kv_blocks=100)
    prompts = prompts_of([2, 5, 1, 7, 3, 4])
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected(p, 6, model) for p in prompts]
    assert all(len(c) <= 3 and sum(c) <= 3 for c in model.calls)
    assert engine.scheduler.max_running == 3


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_with_aborts_and_preemption(fake_tokenizer_dir, seed):
    """Requests arrive while others run, some are aborted, the pool is tight: every finished
    request still equals the reference and every block and state row comes back."""
    import random

    rng = random.Random(seed)
    model = FakeCausalLM(window=5, m=3)
    engine = make_engine(fake_tokenizer_dir, model, max_num_batched_tokens=rng.choice([5, 8, 13]), max_model_len=40,
                         num_kv_blocks=14, max_num_seqs=5)
    pending = {}
    finished = {}
    aborted = set()
    next_id = 0
    for step in range(400):
        if next_id < 24 and rng.random() < 0.4:
            p = prompts_of([rng.randint(1, 25)])[0][::-1]
            rid = f"r{next_id}"
            next_id += 1
            engine.add_request(rid, p, SamplingParams(max_tokens=rng.randint(1, 14), **GREEDY))
            pending[rid] = p
        if pending and rng.random() < 0.05:
            rid = rng.choice(sorted(pending))
            engine.abort_request(rid)
            aborted.add(rid)
            del pending[rid]
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                finished[out.request_id] = (pending.pop(out.request_id), out)
        if next_id >= 24 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests() and len(finished) + len(aborted) == next_id
    for p, out in finished.values():
        assert out.token_ids == expected(p, len(out.token_ids), model, max_model_len=40)
        assert out.finish_reason == "length"
    st = engine.stats()
    assert st.num_preemptions > 0 and aborted
    assert st.kv_blocks_used == 0 and st.num_state_slots_used == 0
    assert all(p.num_free == p.num_blocks for p in engine.kv.pools.values())
