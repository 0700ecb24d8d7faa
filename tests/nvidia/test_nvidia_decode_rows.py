"""A prefix hit's suffix as decode rows through the decode graphs on the nvidia backend (worker/decode_rows.py):
its Triton kernels under the interpreter on the CPU (fp32, tiny shapes), the contract's bucketed graph runner over
a stand-in graph API (static inputs, padded rows; a replay re-runs the captured forward on them).

The eager extend of a few tokens over a short cached context runs the MLA op's prefill-with-context path; the
decode rows run the decode kernel, one row per token, replayed in a padded bucket. Same tokens, logprobs within
fp32 rounding. Bitwise under batch invariance is checked on the cpu backend (tests/engine/test_engine_decode_rows.py)
and on a GPU by tests/engine/test_engine_batch_invariance_gpu.py (graphs on == off, short prompts now included)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
import torch
from nvidia_testutil import DEVICE  # noqa: I001  (sets TRITON_INTERPRET)
from stand_in_graphs import StandInGraphRunner

from deepinfer import EngineConfig, SamplingParams
from deepinfer.backend import BackendCaps, default_buckets
from deepinfer.backends.nvidia.backend import NvidiaBackend
from deepinfer.checkpoints.presets import PRESETS
from deepinfer.checkpoints.random_weights import write_safetensors
from deepinfer.checkpoints.tokenizer_factory import write_tokenizer
from deepinfer.engine import DeepInferenceEngine
from deepinfer.models.registry import load_model
from deepinfer.text.tokenizer import Tokenizer

# the smallest shapes the Triton MLA kernels take, two dense decoder layers (the second reads KV made from the
# first one's output at every row: a wrong row shows), no MoE (the interpreter's time goes by
# kernel launches), as tests/spec/test_spec_nvidia_interpreter.py
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, first_k_dense_replace=2,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=16)
PREFIX = [0] + [(37 * i + 11) % 300 + 2 for i in range(32)]  # 33 tokens: two 16-token blocks get cached
HIT = PREFIX[:32] + [7, 250, 19]  # 35 tokens: 32 from the cache, a 3-token suffix (3 decode rows, bucket 4)
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, logprobs=3, ignore_eos=True)




class GraphNvidiaBackend(NvidiaBackend):
    """The nvidia backend declaring decode graphs, served by the stand-in runner (no CUDA graph API here)."""

    @property
    def caps(self) -> BackendCaps:
        return replace(super().caps, graph_capture=True)

    def make_graph_runner(self, model, caches, block_size, max_model_len, max_num_seqs):
        return StandInGraphRunner.capture(model, caches, block_size, max_model_len, max_num_seqs, self.device,
                                          buckets=default_buckets(max_num_seqs))


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("decode-rows-nvidia"))
    p = PRESETS["tiny-v3"]
    cfg = {**p.hf_config(), **TINY}
    write_safetensors(path, p.tensor_plan(cfg, False), 0, torch.float32)
    write_tokenizer(path, cfg["vocab_size"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    backend = GraphNvidiaBackend(device=DEVICE)
    return path, backend, load_model(path, backend, torch.float32, progress=False), Tokenizer.from_pretrained(path)


def _hit(parts, **kw):
    """(engine, the hit's trace) after PREFIX ran alone: HIT attaches 32 cached tokens and computes 3."""
    path, backend, model, tok = parts
    cfg = EngineConfig(path, device=str(DEVICE), dtype="float32", max_model_len=64, num_kv_blocks=16, block_size=16,
                       max_num_seqs=4, enable_prefix_caching=True, load_progress=False, **kw)
    engine = DeepInferenceEngine.from_components(cfg, model, tok, backend)
    engine.generate([PREFIX], PARAMS, use_tqdm=False)
    out = engine.generate([HIT], PARAMS, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    c = out.outputs[0]
    return engine, (list(c.token_ids), [{t: lp.logprob for t, lp in s.items()} for s in c.logprobs])


def test_a_prefix_hit_replays_the_decode_graphs_as_decode_rows(parts):
    graphed, (g_tok, g_lp) = _hit(parts)
    runner = graphed.runner.graph_runner
    assert graphed.runner.short_extends.num_steps == 1  # the hit's suffix (PREFIX's 33 rows exceed bucket 4)
    assert runner.graphs[4]["replays"] >= 1  # its 3 rows, padded to the bucket of 4
    eager, (e_tok, e_lp) = _hit(parts, enforce_eager=True)  # the prefill-with-context path of the MLA op
    assert eager.runner.graph_runner is None and eager.runner.short_extends.max_tokens == 0
    assert g_tok == e_tok
    for a, b in zip(g_lp, e_lp):  # decode kernel vs prefill kernel: the same attention in another fp32 order
        assert a.keys() == b.keys() and all(math.isclose(a[t], b[t], rel_tol=1e-5, abs_tol=1e-5) for t in a), (a, b)


@pytest.mark.gpu
def test_on_a_gpu_short_extends_through_cuda_graphs_equal_eager(tmp_path):
    """Real CUDA graphs (tiny-v2-lite, fp32): a prefix hit's 8-token suffix and a fresh 5-token prompt in one step
    replay the decode graph as 13 decode rows; tokens equal to enforce_eager, logprobs within fp32 rounding (the
    decode kernel's splits vs the extend's path)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from deepinfer.checkpoints import make_checkpoint

    path = str(tmp_path / "ckpt")
    make_checkpoint("tiny-v2-lite", path, progress=False)
    prefix = [0] + [(37 * i + 11) % 900 + 2 for i in range(299)]
    fresh = [0, 44, 91, 17, 250]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)

    def run(**kw):
        engine = DeepInferenceEngine(EngineConfig(path, device="cuda", dtype="float32", max_model_len=512,
                                                  num_kv_blocks=64, max_num_seqs=16, load_progress=False, **kw))
        bs = engine.kv.block_size
        hit = prefix[: 256 // bs * bs] + [5, 6, 7, 8, 9, 10, 11, 12]
        engine.generate([prefix], params, use_tqdm=False)
        outs = engine.generate([fresh, hit], params, use_tqdm=False)
        assert outs[1].num_cached_tokens == 256 // bs * bs
        return engine, [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in s.items()}
                                                          for s in o.outputs[0].logprobs]) for o in outs]

    graphed, got = run()
    assert graphed.runner.graph_runner is not None and graphed.runner.short_extends.num_steps >= 1
    _, want = run(enforce_eager=True)
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        for a, b in zip(gl, wl):
            assert a.keys() == b.keys() and all(math.isclose(a[t], b[t], rel_tol=1e-4, abs_tol=1e-4) for t in a)
