"""A sampler failure for one request inside a speculative step fails that request only (spec/verify_sampling.py),
as it does without speculation (tests/engine/test_engine_isolation.py): the others' tokens are those of speculation
off, the victim ends with finish_reason "error" and an error naming it and the stage, and the engine goes on."""

from __future__ import annotations

import logging

import pytest

from deepinfer import EngineConfig, SamplingParams
from deepinfer.engine import DeepInferenceEngine
from deepinfer.sample.sampler import Sampler

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
           "def parse_args(argv):\n    parser = "]
VICTIM = 2


def make(parts, **kw) -> DeepInferenceEngine:
    path, backend, model, tok = parts
    cfg = EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64,
                       load_progress=False, **kw)
    return DeepInferenceEngine.from_components(cfg, model, tok, backend)


class RowFailingSampler(Sampler):
    """Raises for the whole batch whenever a row of the victim at `at` or more outputs is in it (verify rows count
    their drafts: num_drawn grows along a sequence's rows)."""

    def __init__(self, base: Sampler, victim: SamplingParams, at: int):
        super().__init__(base.vocab_size, base.eos_token_ids)
        self.victim, self.at = victim, at

    def sample(self, logits, rows, grammar=None):
        if any(r.params is self.victim and r.num_drawn >= self.at for r in rows):
            raise ValueError("injected sampler failure")
        return super().sample(logits, rows, grammar)


@pytest.mark.parametrize("at", [0, 5], ids=["first-token", "mid-stream"])
def test_a_sampler_failure_in_a_verify_step_fails_that_request_only(parts, at, caplog):
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in PROMPTS]
    want = [o.outputs[0].token_ids for o in make(parts).generate(PROMPTS, params, use_tqdm=False)]
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    on.runner.sampler = RowFailingSampler(on.runner.sampler, params[VICTIM], at)
    with caplog.at_level(logging.ERROR, logger="deepinfer"):
        got = on.generate(PROMPTS, params, use_tqdm=False)
    for i, o in enumerate(got):
        if i == VICTIM:
            assert o.finish_reason == "error" and o.error is not None
            assert o.error.startswith(f"internal error in request '{o.request_id}' while sampling: ValueError")
            assert o.outputs[0].token_ids == want[i][: len(o.outputs[0].token_ids)]
            assert len(o.outputs[0].token_ids) <= at
        else:
            assert o.error is None and o.outputs[0].token_ids == want[i], f"request {i} was disturbed"
    assert on.stats().spec_accepted_tokens > 0 and on.stats().kv_blocks_used == 0
    assert any("injected sampler failure" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    # the engine goes on: the same prompts again, the victim's params replaced
    again = on.generate(PROMPTS[:2], params[:2], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want[:2]


def test_a_batch_failure_no_request_reproduces_alone_raises(parts):
    """Not one request's failure (the batch raises, every sequence's rows alone do not): the step raises."""

    class BatchOnly(Sampler):
        def sample(self, logits, rows, grammar=None):
            if len({r.params.seed for r in rows}) > 1 and len(rows) > 4:
                raise RuntimeError("injected batch failure")
            return super().sample(logits, rows, grammar)

    on = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    base = on.runner.sampler
    on.runner.sampler = BatchOnly(base.vocab_size, base.eos_token_ids)
    params = [SamplingParams(temperature=0.0, max_tokens=8, seed=i) for i in range(4)]
    with pytest.raises(RuntimeError, match="injected batch failure"):
        on.generate(PROMPTS, params, use_tqdm=False)
