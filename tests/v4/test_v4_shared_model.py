"""Engines that share one V4 model (DeepInferenceEngine.from_components, as the CPU speculation benchmark builds its
modes) keep their own prefix-cache ring snapshots: the store lives on the model, and each engine binds its own to it
at every step (ModelRunner.plan_snapshots). Before that binding (found on a trained V4, session 37) a model saved
every engine's rings into the store of the engine built last: a prefix hit then restored rings nobody had saved for
it and the tokens after it differed, and with n-gram drafts, whose rings are k positions longer, the save raised."""

from __future__ import annotations

import pytest
import torch
from v4_helpers import engine as own_model_engine

from deepinfer import EngineConfig, SamplingParams
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.engine import DeepInferenceEngine
from deepinfer.models.registry import load_model
from deepinfer.text.tokenizer import Tokenizer

SPEC = {"ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
        "mtp": {"speculative_method": "mtp", "num_speculative_tokens": 1}}


def _prompts() -> list[list[int]]:
    """Prompts past two 16-token blocks (their second run hits the prefix cache), ids in repeated units so the
    n-gram drafter proposes."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (35, 41):
        unit = torch.randint(3, 200, (5,), generator=g).tolist()
        out.append([0] + (unit * 9)[:n])
    return out


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_engines_sharing_a_v4_model_restore_their_own_rings(tiny_dir, method):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = _prompts()
    want = [o.outputs[0].token_ids
            for o in own_model_engine(tiny_dir, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)]
    backend = CPUBackend()
    model = load_model(tiny_dir, backend, torch.float32, progress=False, load_mtp=True)
    tok = Tokenizer.from_pretrained(tiny_dir)

    def build(**kw):
        cfg = EngineConfig(model_name_or_path=tiny_dir, device="cpu", dtype="float32", max_model_len=128,
                           num_kv_blocks=256, load_progress=False, **kw)
        return DeepInferenceEngine.from_components(cfg, model, tok, backend)

    off, on = build(), build(**SPEC[method])  # (the model's store was the last-built engine's: `on`'s)
    for e in (off, on, off, on):  # each engine's second run restores rings at its prompts' block boundaries
        got = [o.outputs[0].token_ids for o in e.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert off.stats().prefix_cache_hit_tokens > 0 and on.stats().prefix_cache_hit_tokens > 0
