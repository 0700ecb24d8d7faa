"""The public Python API on a real tiny checkpoint: the quickstart exactly, prompt forms, chat,
the LLM alias, n > 1, logprobs, seeded sampling independent of the batch, stats."""

from __future__ import annotations

import pytest

from deepinfer import LLM, DeepInferenceEngine, EngineConfig, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def small_engine(checkpoint):
    return DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=checkpoint("tiny-v3"), device="cpu", max_model_len=256, num_kv_blocks=64,
                     load_progress=False)
    )


def test_quickstart_runs_exactly(checkpoint, capsys):
    path = checkpoint("tiny-v3")
    config = EngineConfig(model_name_or_path=path, tensor_parallel_size=1, max_model_len=8192,
                          gpu_memory_utilization=0.90, enforce_eager=False, quantization=None, device="cpu")
    engine = DeepInferenceEngine.from_config(config)
    outputs = engine.generate(["Hello", "World"], temperature=0.6, top_p=0.9, max_tokens=64)
    for o in outputs:
        print(o.prompt, o.text, o.token_ids, o.finish_reason)
    assert [o.prompt for o in outputs] == ["Hello", "World"]
    assert all(isinstance(o, RequestOutput) and o.finished for o in outputs)
    assert all(1 <= len(o.token_ids) <= 64 and o.finish_reason in ("stop", "length") for o in outputs)
    assert all(o.finish_reason == "stop" or len(o.token_ids) == 64 for o in outputs)
    assert engine.max_model_len == 8192 and engine.backend_name == "cpu" and engine.model_name == path
    assert engine.dtype == __import__("torch").float32  # dtype "auto" on the CPU backend
    st = engine.stats()
    assert st.kv_blocks_used == 0 and st.kv_capacity_tokens >= 8192 and st.num_requests_finished == 2


def test_llm_alias_and_kwargs_constructor(checkpoint):
    assert LLM is DeepInferenceEngine
    llm = LLM(model=checkpoint("tiny-v3"), device="cpu", max_model_len=64, num_kv_blocks=8, load_progress=False)
    (o,) = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(o.token_ids) == 3


def test_prompt_forms_agree(small_engine):
    e = small_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = e.tokenizer.encode("The quick brown fox")
    a = e.generate("The quick brown fox", greedy, use_tqdm=False)
    b = e.generate(ids, greedy, use_tqdm=False)
    c = e.generate([ids, "The quick brown fox"], [greedy, greedy], use_tqdm=False)
    import numpy as np

    d = e.generate([[np.int64(t) for t in ids]], greedy, use_tqdm=False)
    assert a[0].token_ids == b[0].token_ids == c[0].token_ids == c[1].token_ids == d[0].token_ids
    assert all(type(t) is int for t in d[0].prompt_token_ids)
    assert a[0].prompt == "The quick brown fox" and b[0].prompt is None and a[0].prompt_token_ids == ids
    assert a[0].text == e.tokenizer.decode(a[0].token_ids)


def test_chat_uses_the_template(small_engine):
    e = small_engine
    msgs = [{"role": "user", "content": "Say hi"}]
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    (o,) = e.chat(msgs, use_tqdm=False, **greedy)
    rendered = e.tokenizer.apply_chat_template(msgs)
    (ref,) = e.generate(rendered, use_tqdm=False, **greedy)
    assert o.prompt == rendered and o.token_ids == ref.token_ids
    assert o.prompt_token_ids.count(e.tokenizer.bos_token_id) == 1
    two = e.chat([msgs, msgs + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]],
                 use_tqdm=False, **greedy)
    assert len(two) == 2 and two[0].token_ids == o.token_ids


def test_seeded_request_is_batch_independent(small_engine):
    e = small_engine
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=42, ignore_eos=True)
    alone = e.generate("Once upon a time", p, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (3, 17, 9)]
    batch = e.generate(["x y z", "Once upon a time", "a much longer prompt with several words in it", "q"],
                       [others[0], p, others[1], others[2]], use_tqdm=False)
    assert batch[1].token_ids == alone
    other_seed = e.generate("Once upon a time", SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=43,
                                                               ignore_eos=True), use_tqdm=False)[0].token_ids
    assert other_seed != alone


def test_n_and_logprobs(small_engine):
    e = small_engine
    (o,) = e.generate("Hello", SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1, logprobs=2, ignore_eos=True),
                      use_tqdm=False)
    assert len(o.outputs) == 3 and len({tuple(c.token_ids) for c in o.outputs}) > 1
    for c in o.outputs:
        assert len(c.logprobs) == 8
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and len(lp) <= 3 and lp[tok].logprob <= 0
            assert all(v.decoded is not None for v in lp.values())


def test_streaming_api(small_engine):
    e = small_engine
    e.add_request("s1", "Hello there", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    e.add_request("s2", [0, 10, 11], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert e.stats().num_waiting == 2
    final = {}
    lengths = {"s1": [], "s2": []}
    while e.has_unfinished_requests():
        for out in e.step():
            lengths[out.request_id].append(len(out.token_ids))
            if out.finished:
                final[out.request_id] = out
    assert lengths == {"s1": [1, 2, 3, 4, 5], "s2": [1, 2, 3]}
    assert final["s1"].text == e.tokenizer.decode(final["s1"].token_ids)
    st = e.stats()
    assert st.kv_blocks_used == 0 and st.num_running == 0 and st.generation_tokens_total >= 8


def test_stop_string_and_stop_token_end_to_end(small_engine):
    e = small_engine
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    (free,) = e.generate("The weather today", use_tqdm=False, **greedy)
    text, ids = free.text, free.token_ids
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    (o,) = e.generate("The weather today", use_tqdm=False, stop=[stop], **greedy)
    assert o.finish_reason == "stop" and o.outputs[0].stop_reason == stop and o.text == text[:cut]
    (o,) = e.generate("The weather today", use_tqdm=False, stop=[stop], include_stop_str_in_output=True, **greedy)
    assert o.text == text[: cut + len(stop)]
    (o,) = e.generate("The weather today", use_tqdm=False, stop_token_ids=[ids[5]], **greedy)
    k = ids.index(ids[5])
    assert o.token_ids == ids[: k + 1] and o.finish_reason == "stop" and o.outputs[0].stop_reason == ids[5]
