"""The speculation benchmark checkpoints (deepinfer/checkpoints/presets_mtp_bench.py): what the construction promises,
checked against the checkpoint's own tensors with plain torch (not the model code): the main model's greedy next
token is f(t) = argmax lm_head . rms_norm(embed(t)), the MTP module's draft after t is f_mtp(t) = argmax lm_head .
rms_norm((I + N) rms_norm(embed(t))), and so a static-k=1 engine's drafted and accepted counts are those of the
greedy walk that accepts where f_mtp(t) == f(t)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from deepinfer import EngineConfig, SamplingParams
from deepinfer.checkpoints import PRESETS, make_checkpoint
from deepinfer.checkpoints.presets_mtp_bench import LOGIT_STD
from deepinfer.engine import DeepInferenceEngine

PROMPTS = ["def f(x):\n", "import os\n", "class A:\n"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def bench_ckpt(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny-mtp-bench"))
    make_checkpoint("tiny-mtp-bench", out)
    return out


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _maps(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """f and f_mtp over the whole vocabulary, from the stored tensors."""
    t = load_file(f"{path}/model.safetensors")
    cfg = PRESETS["tiny-mtp-bench"].config
    n, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    E, W = t["model.embed_tokens.weight"].double(), t["lm_head.weight"].double()
    eh = t[f"model.layers.{n}.eh_proj.weight"].double()
    assert torch.equal(eh[:, D:], torch.zeros(D, D, dtype=eh.dtype))  # the MTP module ignores the hidden state
    e = _rms(E)
    f = (e @ W.T).argmax(-1)
    f_mtp = (_rms(e @ eh[:, :D].T) @ W.T).argmax(-1)
    return f, f_mtp


def _run(path: str, **spec) -> tuple[list[list[int]], object]:
    eng = DeepInferenceEngine.from_config(EngineConfig(model_name_or_path=path, device="cpu", dtype="float32",
                                                       max_model_len=256, load_progress=False, **spec))
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], eng.stats()


def test_tensor_plan_shapes_and_kinds():
    """Every linear but the routers zero, norms exactly one, lm_head at LOGIT_STD, eh_proj the identity plus noise."""
    p = PRESETS["v2-lite-mtp-bench"]
    cfg = p.hf_config()
    specs = {s.name: s for s in p.tensor_plan(cfg, False)}
    n, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    assert cfg["num_nextn_predict_layers"] == 1 and D == 2048 and cfg["n_routed_experts"] == 64
    assert specs[f"model.layers.{n}.eh_proj.weight"].kind == "identity"
    assert specs[f"model.layers.{n}.mlp.experts.63.down_proj.weight"].kind == "zeros"
    assert specs["model.layers.3.self_attn.o_proj.weight"].kind == "zeros"
    assert specs["model.layers.3.mlp.gate.weight"].kind == "normal"
    assert math.isclose(specs["lm_head.weight"].std * math.sqrt(D), LOGIT_STD)
    norms = [s for s in specs.values() if s.kind == "norm"]
    assert norms and all(s.std == 0.0 for s in norms)
    assert PRESETS["v2-lite-mtp-bench-27l"].config["num_hidden_layers"] == 27
    with pytest.raises(ValueError, match="bf16 / fp32 only"):
        p.tensor_plan(cfg, True)


def test_greedy_follows_the_constructed_map(bench_ckpt):
    """Off: every generated token is f of the one before it (the layers add nothing to the embedding)."""
    f, _ = _maps(bench_ckpt)
    outs, _ = _run(bench_ckpt)
    for out in outs:
        assert len(out) == MAX_TOKENS
        assert [int(f[a]) for a in out[:-1]] == out[1:]


def test_static_k1_accepts_where_the_maps_agree(bench_ckpt):
    """Static k = 1 gives the off run's tokens, and its drafted and accepted counts are the walk's: from the last
    token t a step verifies f_mtp(t), accepted iff it equals f(t) (then two tokens are emitted, else one), and no
    draft is verified where the two emitted tokens would pass max_tokens."""
    f, f_mtp = _maps(bench_ckpt)
    off, _ = _run(bench_ckpt)
    outs, stats = _run(bench_ckpt, speculative_method="mtp", num_speculative_tokens=1)
    assert outs == off
    drafted = accepted = 0
    for out in outs:
        n = 1  # the prefill emits the first token; every step after it drafts from the last one
        while n < MAX_TOKENS:
            if MAX_TOKENS - n - 1 >= 1:
                drafted += 1
                if int(f_mtp[out[n - 1]]) == int(f[out[n - 1]]):
                    accepted += 1
                    n += 2
                    continue
            n += 1
    assert stats.spec_drafted_tokens == drafted
    assert stats.spec_accepted_tokens == accepted
    assert 0 < accepted < drafted  # the noise rejects some drafts and keeps most
