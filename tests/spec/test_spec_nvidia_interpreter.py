"""Speculative decoding on the nvidia backend: its Triton kernels under the interpreter on the CPU (tiny shapes,
fp32), or on a GPU when one is visible; plus a GPU-only check at DeepSeek-V2-Lite-like shapes in bf16.

What the nvidia MLA op must serve with drafts: a verify row is 1 + k query tokens on a cached context. With
decode graphs (a stand-in graph API here, `StandInGraphRunner`) a step of decodes and verify rows replays the
decode graphs as one decode row per token (spec/verify_batch.py; graphs captured for max_num_seqs * (1 + k)
rows); eagerly (enforce_eager, or more rows than the largest bucket) `TritonMLAAttention._attend` sends a verify
row through its prefill-with-context path (the decode fast path and the fused W_UK absorb are chosen only when
every row has one query token). The MTP module's own attention layer (layer id num_hidden_layers, same blocks)
runs through the same op, eagerly, its chain links as 1-token decodes.

The model: random weights that still make drafts worth verifying, so a step accepts some drafts and rejects
the rest (the rollback after partial acceptance). lm_head is the embedding with its rows permuted, so with no
layers the greedy next token of t would be perm[t]; the decoder layers' outputs are scaled up (ALPHA) until
they change that for some contexts. The MTP module's eh_proj passes the next token's embedding through
(h is ignored) into a copy of the last decoder layer, so it drafts perm[t] perturbed differently: right
often, wrong sometimes. One prompt holds a perm cycle, so prompt lookup (n-gram) finds continuations.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import pytest
import torch
from safetensors.torch import load_file, save_file
from stand_in_graphs import StandInGraphRunner

from deepinfer import EngineConfig, SamplingParams
from deepinfer.backend import BackendCaps, default_buckets
from deepinfer.backends.nvidia.backend import NvidiaBackend
from deepinfer.checkpoints.presets import PRESETS
from deepinfer.checkpoints.random_weights import write_safetensors
from deepinfer.checkpoints.tokenizer_factory import write_tokenizer
from deepinfer.engine import DeepInferenceEngine
from deepinfer.engine.startup import check_speculation
from deepinfer.errors import ConfigError
from deepinfer.models.registry import load_model
from deepinfer.text.tokenizer import Tokenizer

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"  # cpu: tests/conftest.py set TRITON_INTERPRET=1 before any kernel was defined
# kv_lora 16 and 2 heads: the smallest shapes the Triton MLA kernels take; one decoder layer (the interpreter's
# time goes by kernel launches) and no MoE layer (first_k_dense_replace past the MTP layer): the MoE kernels were
# ~75% of the interpreter's time and see tokens, not sequences
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1, first_k_dense_replace=2,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=16)
ALPHA = 3.0  # measured (cpu backend, same tokens): mtp k=3 accepts 18 of 22 drafts, slots 2-3 rejected at times;
# n-gram 4 of 8; at 2.0 mtp accepts every draft, at 4.0 n-gram none
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=8, ignore_eos=True)


def make_drafting_checkpoint(out: str, preset: str, changes: dict, alpha: float, dtype: torch.dtype,
                             seed: int = 0) -> torch.Tensor:
    """A checkpoint of `preset` + `changes` with one MTP module (see the module docstring); returns perm."""
    p = PRESETS[preset]
    cfg = {**p.hf_config(), **changes}
    os.makedirs(out, exist_ok=True)
    write_safetensors(out, p.tensor_plan(cfg, False), seed, torch.float32)
    write_tokenizer(out, cfg["vocab_size"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 1}, f)
    t = load_file(os.path.join(out, "model.safetensors"))
    n, D, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(seed + 1))
    t["lm_head.weight"] = t["model.embed_tokens.weight"][perm.argsort()].clone()  # row perm[t] = E[t]
    t["model.norm.weight"] = torch.ones(D)
    for i in range(n):
        for w in ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_experts.down_proj"):
            if f"model.layers.{i}.{w}.weight" in t:
                t[f"model.layers.{i}.{w}.weight"] *= alpha
    for k in [k for k in t if k.startswith(f"model.layers.{n - 1}.")]:
        t[k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = t[k].clone()
    t[f"model.layers.{n}.eh_proj.weight"] = torch.cat([torch.eye(D), torch.zeros(D, D)], 1)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        t[f"model.layers.{n}.{norm}.weight"] = torch.ones(D)
    save_file({k: v.to(dtype) for k, v in t.items()}, os.path.join(out, "model.safetensors"))
    return perm


def prompts(perm: torch.Tensor) -> list[list[int]]:
    cycle = [11]
    for _ in range(7):
        cycle.append(int(perm[cycle[-1]]))
    return [[5, 9, 17, 33, 2, 8], [100, 101, 102, 100, 101], cycle + cycle[:2]]




class GraphNvidiaBackend(NvidiaBackend):
    """The nvidia backend declaring decode graphs, served by the stand-in runner (no CUDA graph API here): the
    default buckets for the rows asked for (max_num_seqs, or max_num_seqs * (1 + k) with speculation), none
    above max_bucket (a test lowers it to make verify steps outgrow the largest bucket)."""

    max_bucket = 1 << 30

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked_rows: list[int] = []  # the rows each make_graph_runner call was asked to cover

    @property
    def caps(self) -> BackendCaps:
        return replace(super().caps, graph_capture=True)

    def make_graph_runner(self, model, caches, block_size, max_model_len, max_num_seqs):
        self.asked_rows.append(max_num_seqs)
        buckets = [b for b in default_buckets(max_num_seqs) if b <= self.max_bucket]
        return StandInGraphRunner.capture(model, caches, block_size, max_model_len, max_num_seqs, self.device,
                                          buckets=buckets)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec-nvidia"))
    perm = make_drafting_checkpoint(path, "tiny-v3", TINY, ALPHA, torch.float32)
    backend = GraphNvidiaBackend(device=DEVICE)
    model = load_model(path, backend, torch.float32, progress=False, load_mtp=True)
    return path, backend, model, Tokenizer.from_pretrained(path), prompts(perm)


def make(parts, **kw) -> DeepInferenceEngine:
    path, backend, model, tok, _ = parts
    settings = dict(model_name_or_path=path, device=DEVICE, dtype="float32", max_model_len=64, num_kv_blocks=24,
                    block_size=16, max_num_seqs=4, load_progress=False)
    settings.update(kw)
    return DeepInferenceEngine.from_components(EngineConfig(**settings), model, tok, backend)


def run(engine, ps, params):
    outs = engine.generate(ps, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.fixture(scope="module")
def off(parts):
    """Speculation off, eager: the prompts greedy and the last one again seeded, in one batch of four."""
    ps = parts[4]
    return run(make(parts, enforce_eager=True), ps + ps[-1:], [GREEDY] * len(ps) + [SEEDED])


def replays(engine) -> int:
    return sum(g["replays"] for g in engine.runner.graph_runner.graphs.values())


def assert_graph_counts(on, before: int, eager_verify: int | None = 0) -> None:
    """Every decode step replayed a graph: the draft-less ones and the verify steps (as decode rows), except
    `eager_verify` verify steps (None: any number > 0) too large for the largest bucket, which ran eagerly."""
    spec = on._spec
    budgets = spec.metrics.budgets  # drafts verified per decode step (the run has < 1024 steps)
    with_drafts = sum(b > 0 for b in budgets)
    assert with_drafts > 0, budgets
    assert spec.shapes.num_graph_verify_steps + spec.shapes.num_eager_verify_steps == with_drafts, (budgets, spec.shapes)
    if eager_verify is None:
        assert spec.shapes.num_eager_verify_steps > 0 and spec.shapes.num_graph_verify_steps > 0, spec.shapes
    else:
        assert spec.shapes.num_eager_verify_steps == eager_verify, spec.shapes
    draftless = sum(b == 0 for b in budgets)
    assert replays(on) - before == draftless + spec.shapes.num_graph_verify_steps


def test_mtp_greedy_and_seeded_equal_off_with_partial_acceptance(parts, off):
    """mtp, k = 3, one batch of greedy and seeded requests, decode graphs on: every verify step replays the decode
    graphs as decode rows (captured up to max_num_seqs * (1 + k) = 16 rows); the tokens of speculation off
    (eager), the greedy logprobs within fp32 rounding (a graph's decode kernel runs at the bucket's batch size);
    drafts accepted, rejected, and a slot rejected after its predecessor was accepted (rolled back)."""
    ps = parts[4]
    mixed = ps + ps[-1:]
    params = [GREEDY] * len(ps) + [SEEDED]
    want, want_outs = off
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    assert parts[1].asked_rows[-1] == 16  # recaptured for 4 * (1 + 3) rows
    assert on.runner.graph_runner.buckets[-1] == 16
    before = replays(on)
    got, got_outs = run(on, mixed, params)
    assert got == want
    assert_graph_counts(on, before)
    for a, b in zip(want_outs[: len(ps)], got_outs[: len(ps)]):
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    st = on.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_drafted_tokens, st
    assert st.spec_conditional_acceptance[0] > 0, st
    assert any(c < 1 for c in st.spec_conditional_acceptance[1:]), st  # accepted slot j, rejected slot j + 1
    assert st.spec_tau > 1.2, st  # steps emitted several tokens
    assert st.kv_blocks_used == 0  # every verify step's and MTP lookahead's blocks came back


def test_mtp_verify_steps_past_the_largest_bucket_run_eagerly(parts, off):
    """Buckets capped at 8 rows: a verify step of more rows (4 sequences with 3 drafts: 16) runs eagerly in its
    varlen form, a smaller one (drafts shortened near max_tokens, or fewer sequences) replays as decode rows;
    output == off either way."""
    ps = parts[4]
    mixed = ps + ps[-1:]
    backend = parts[1]
    backend.max_bucket = 8
    try:
        on = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    finally:
        backend.max_bucket = GraphNvidiaBackend.max_bucket
    assert on.runner.graph_runner.buckets == [1, 2, 4, 8]
    before = replays(on)
    got, _ = run(on, mixed, [GREEDY] * len(ps) + [SEEDED])
    assert got == off[0]
    assert_graph_counts(on, before, eager_verify=None)


def test_ngram_equals_off_and_verify_steps_replay_decode_graphs(parts, off):
    """n-gram drafts on an engine with decode graphs: draft-less steps and verify steps (as decode rows) replay
    the graphs; greedy output == off (eager), drafts partly accepted."""
    ps = parts[4]
    want = off[0][: len(ps)]
    on = make(parts, speculative_method="ngram", num_speculative_tokens=3)
    before = replays(on)
    got, _ = run(on, ps, GREEDY)
    assert got == want
    st = on.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_drafted_tokens, st
    assert_graph_counts(on, before)


def test_adaptive_step_costs_are_profiled_by_graph_replays(parts):
    """The confidence scheduler's step-cost table, with decode graphs: every profiled count (1..4 tokens, the
    token budget) is within the verify buckets (2 sequences x (1 + k=1) rows), so each is timed as graph
    replays (two per count), not eagerly. (Small sizes: an interpreted forward costs ~1 s here.)"""
    on = make(parts, speculative_method="mtp", num_speculative_tokens=1, speculative_adaptive=True,
              max_num_seqs=2, max_num_batched_tokens=4)
    assert on.runner.graph_runner.buckets == [1, 2, 4]
    assert on._spec.policy.cost.tokens == [1, 2, 4]
    assert replays(on) == 2 * 3


def test_fp8_kv_cache_with_speculation_equals_off(parts):
    """fp8 e4m3 latent cache: a verify row's prefill path dequantizes the rows it gathers, the decode kernel
    converts in registers; both read the same stored values, so the tokens are those of speculation off."""
    ps, params = parts[4][2:], replace(GREEDY, max_tokens=6)
    want, _ = run(make(parts, kv_cache_dtype="fp8", enforce_eager=True), ps, params)
    on = make(parts, kv_cache_dtype="fp8", speculative_method="mtp", num_speculative_tokens=2, enforce_eager=True)
    got, _ = run(on, ps, params)
    assert got == want
    assert on.stats().spec_accepted_tokens > 0


def test_batch_invariant_speculation_is_bitwise_equal_to_off(parts):
    """Batch invariance on: a verify row's bits are a decode's (InvariantMLAAttention), so n-gram speculation gives
    bitwise the tokens and top-2 logprobs of off (eager); one draft accepted, the next rejected; the verify steps
    replay the decode graphs as decode rows; then MTP drafts (k = 1) with the steps scheduled async (chained on the
    device results of the step in flight): the same bits. (The invariant kernels are slow under the interpreter: one
    prompt, one sequence, four tokens: n-gram's first step verifies 2 drafts and accepts 1, a draft-less step
    follows; MTP runs 2 chained steps, 2 of 3 drafts accepted; seeded was checked by hand, docs.)"""
    path, _, _, tok, ps = parts
    backend = GraphNvidiaBackend(device=DEVICE)
    backend.enable_batch_invariance()
    model = load_model(path, backend, torch.float32, progress=False, load_mtp=True)
    inv = (path, backend, model, tok, ps)
    params = replace(GREEDY, max_tokens=4, logprobs=2)

    def trace(engine):
        c = engine.generate(ps[2:], params, use_tqdm=False)[0].outputs[0]
        return c.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs]

    want = trace(make(inv, batch_invariant=True, enforce_eager=True))
    on = make(inv, batch_invariant=True, speculative_method="ngram", num_speculative_tokens=2, max_num_seqs=1)
    before = replays(on)
    assert trace(on) == want
    st = on.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_drafted_tokens, st
    assert_graph_counts(on, before)
    # MTP drafts, steps scheduled async (spec/chained_steps.py): the same bits
    chained = make(inv, batch_invariant=True, speculative_method="mtp", num_speculative_tokens=1, max_num_seqs=1,
                   async_scheduling=True)
    assert trace(chained) == want
    st = chained.stats()
    assert chained._spec.num_chained_steps >= 1 and 0 < st.spec_accepted_tokens < st.spec_drafted_tokens, st


@dataclass
class _Caps:
    device_type: str
    graph_capture: bool = True


@dataclass
class _Backend:
    """What check_speculation reads of a backend."""

    name: str
    caps: _Caps
    device: torch.device


def test_check_speculation_lets_nvidia_through_and_names_what_it_refuses():
    cfg = EngineConfig(speculative_method="ngram")
    check_speculation(cfg, _Backend("nvidia", _Caps("cuda"), torch.device("cpu")), "deepseek_v2", 0)
    with pytest.raises(ConfigError, match=r"backend 'ascend': verification steps are built and tested on the cpu "
                                          r"and nvidia backends only"):
        check_speculation(cfg, _Backend("ascend", _Caps("npu"), torch.device("cpu")), "deepseek_v3", 1)
    # async scheduling: MTP steps chained on the device (spec/chained_steps.py) where graphs replay them
    on = EngineConfig(speculative_method="mtp", async_scheduling=True)
    check_speculation(on, _Backend("nvidia", _Caps("cuda"), torch.device("cpu")), "deepseek_v3", 1)
    with pytest.raises(ConfigError, match=r"async_scheduling=True .*backend 'nvidia' captures none"):
        check_speculation(on, _Backend("nvidia", _Caps("cuda", graph_capture=False), torch.device("cpu")),
                          "deepseek_v3", 1)
    with pytest.raises(ConfigError, match=r"async_scheduling=True .*per-sequence state \(V4\)"):
        check_speculation(on, _Backend("nvidia", _Caps("cuda"), torch.device("cpu")), "deepseek_v4", 1)
    with pytest.raises(ConfigError, match=r"async_scheduling=True .*one rank"):
        check_speculation(replace(on, tensor_parallel_size=2), _Backend("nvidia", _Caps("cuda"), torch.device("cpu")),
                          "deepseek_v3", 1)


# ---------------------------------------------------------------- GPU (never run yet: no GPU in this session)

V2_LITE_LIKE = dict(num_hidden_layers=3, max_position_embeddings=4096)  # v2-lite's shapes, 3 layers + 1 MTP


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("invariant", [False, True], ids=["default-kernels", "batch-invariant"])
def test_gpu_v2_lite_shapes_bf16_greedy_speculation_equals_off(tmp_path_factory, invariant):
    """V2-Lite shapes (hidden 2048, 16 heads, kv_lora 512, 64 experts top-6), bf16, CUDA graphs on: greedy
    mtp and n-gram speculation give the tokens of speculation off. With the default kernels a verify row
    and a decode round differently in bf16, so a sequence may part from off's only where off's own top two
    logprobs are within 0.02 (a tie at bf16 precision); with batch invariance the tokens and logprobs are
    bitwise off's."""
    path = str(tmp_path_factory.mktemp("spec-v2-lite"))
    perm = make_drafting_checkpoint(path, "v2-lite", V2_LITE_LIKE, 1.0, torch.bfloat16)
    backend = NvidiaBackend(device="cuda")
    if invariant:
        backend.enable_batch_invariance()
    model = load_model(path, backend, torch.bfloat16, progress=False, load_mtp=True)
    tok = Tokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(5)
    ps = prompts(perm) + [torch.randint(2, 102400, (n,), generator=g).tolist() for n in (40, 130, 300, 17, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)

    def engine(**kw):
        cfg = EngineConfig(model_name_or_path=path, device="cuda", dtype="bfloat16", max_model_len=512,
                           num_kv_blocks=256, max_num_seqs=16, batch_invariant=invariant, load_progress=False, **kw)
        return DeepInferenceEngine.from_components(cfg, model, tok, backend)

    off = engine()
    assert off.runner.graph_runner is not None
    want = off.generate(ps, params, use_tqdm=False)
    for method, k in (("mtp", 3), ("ngram", 3), ("mtp", 1)):
        on = engine(speculative_method=method, num_speculative_tokens=k)
        got = on.generate(ps, params, use_tqdm=False)
        st = on.stats()
        assert st.spec_drafted_tokens > 0, (method, st)
        for a, b in zip(want, got):
            ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
            if invariant:
                assert tb == ta, (method, k)
                assert [sorted((t, lp.logprob) for t, lp in s.items()) for s in b.outputs[0].logprobs] == \
                    [sorted((t, lp.logprob) for t, lp in s.items()) for s in a.outputs[0].logprobs], (method, k)
                continue
            j = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
            if j is None:
                assert len(ta) == len(tb)
                continue
            step = a.outputs[0].logprobs[j]
            assert tb[j] in step, (method, k, j)  # off's runner-up at least
            assert step[ta[j]].logprob - step[tb[j]].logprob < 0.02, (method, k, j, step)
        if method == "mtp" and k == 3:
            assert st.spec_accepted_tokens > 0, st
