"""V4's MTP module (models/deepseek_v4/mtp.py) against transformers' DeepSeek-V4 block, and MTP drafting in the engine.

transformers ignores `mtp.*`, but its decoder layer is the V4 block the MTP module wraps. So the reference is a
transformers model one layer deeper, whose layer L (= num_hidden_layers) holds the `mtp.0` block's tensors (its
layer type from compress_ratios' entry past the main layers, a plain MoE): run over the sequence, its layers
0..L-1 compute the main model's residual streams; a hook on layer L's input fuses them with the next tokens as
DeepSeek's `MTPBlock.forward` does (enorm / e_proj, hnorm / h_proj, in transformers' RMSNorm), and transformers'
HyperHead with the module's own hc_head tensors, then its norm and the shared head, give the draft logits. Ours
runs the pass over a paged cache in chunks and a chain link one position past it (the lookahead the drafter writes).
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from v4_helpers import engine as _engine
from v4_helpers import off_prompts

from deepinfer import SamplingParams
from deepinfer.errors import ConfigError, ModelLoadError

BLOCK_ONLY = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.", "hc_head_")


def _mtp_type(cfg: dict) -> str:
    r = cfg["compress_ratios"][cfg["num_hidden_layers"]]
    rates = cfg["compress_rates"]
    return {0: "sliding_attention", rates["compressed_sparse_attention"]: "compressed_sparse_attention",
            rates["heavily_compressed_attention"]: "heavily_compressed_attention"}[r]


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """(transformers model with the MTP block as its last layer, the module's own tensors by short name)."""
    pytest.importorskip("transformers", minversion="5.24")
    from transformers import DeepseekV4ForCausalLM as HF

    with open(os.path.join(tiny_dir, "config.json")) as f:
        cfg = json.load(f)
    L = cfg["num_hidden_layers"]
    tensors = {}
    for path in glob.glob(os.path.join(tiny_dir, "*.safetensors")):
        tensors.update(load_file(path))
    out = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    own = {}
    for k, v in tensors.items():
        if k.startswith("mtp.0."):
            rest = k[len("mtp.0."):]
            if rest.startswith(BLOCK_ONLY):
                own[rest] = v
            else:
                out[f"layers.{L}.{rest}"] = v
    hf_cfg = {**cfg, "num_hidden_layers": L + 1, "num_nextn_predict_layers": 0,
              "layer_types": cfg["layer_types"] + [_mtp_type(cfg)], "mlp_layer_types": cfg["mlp_layer_types"] + ["moe"]}
    d = str(tmp_path_factory.mktemp("v4_mtp_ref"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf_cfg, f)
    save_file(out, os.path.join(d, "model.safetensors"))
    return HF.from_pretrained(d, dtype=torch.float32).eval(), own


@torch.no_grad()
def _reference_mtp(hf, own: dict, ids: list[int], chain_token: int | None = None):
    """Draft logits of the MTP module at positions 0..T-1 of ids[:T] (T = len(ids) - 1, the next token of
    position i being ids[i + 1]); with chain_token, also the chain link at position T: the module's own streams
    at T - 1 with chain_token as the next token (the main layers run a throw-away token there)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead, DeepseekV4RMSNorm

    cfg = hf.config
    L = cfg.num_hidden_layers - 1
    D = cfg.hidden_size

    def rms(name):
        m = DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps)
        m.weight.data = own[f"{name}.weight"].float()
        return m

    enorm, hnorm, norm = rms("enorm"), rms("hnorm"), rms("norm")
    head = DeepseekV4HyperHead(cfg)
    for attr in ("fn", "base", "scale"):
        getattr(head, f"hc_{attr}").data = own[f"hc_head_{attr}"].float()
    embed = hf.model.embed_tokens
    T = len(ids) - 1
    fused_in: dict = {}
    seen: list[torch.Tensor] = []

    def pre(_mod, args, kwargs):
        h = args[0]  # [1, S, hc, D]: the main model's streams after its last block
        e = F.linear(enorm(embed(fused_in["next"])), own["e_proj.weight"].float())
        if "state" in fused_in:
            h = fused_in["state"]
        x = F.linear(hnorm(h), own["h_proj.weight"].float()) + e.unsqueeze(2)
        return (x, *args[1:]), kwargs

    def post(_mod, _args, _kwargs, output):
        seen.append(output)

    layer = hf.model.layers[L]
    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True),
               layer.register_forward_hook(post, with_kwargs=True)]
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=cfg)
        fused_in["next"] = torch.tensor([ids[1:]])
        hf.model(input_ids=torch.tensor([ids[:T]]), cache=cache, use_cache=True)
        logits = [hf.lm_head(norm(head(seen[-1])))[0]]
        if chain_token is not None:
            fused_in["next"] = torch.tensor([[chain_token]])
            fused_in["state"] = seen[-1][:, -1:]
            hf.model(input_ids=torch.tensor([[ids[-1]]]), cache=cache, use_cache=True)
            logits.append(hf.lm_head(norm(head(seen[-1])))[0])
    finally:
        for h in handles:
            h.remove()
    return torch.cat(logits).float()


@pytest.fixture(scope="module")
def mtp_model(tiny_dir):
    from v4_helpers import load_ours

    return load_ours(tiny_dir, load_mtp=True)


@torch.no_grad()
def _ours(model, ids: list[int], chunks: list[int], chain_token: int):
    """The pass over positions 0..T-1 in chunks through a paged cache (each after the main forward of the same
    chunk, as the engine runs it), then one chain link at position T from the module's own state."""
    from v4_helpers import PagedRunner

    r = PagedRunner(model, specs=model.kv_cache_specs(include_mtp=True))
    r.add(0)
    T = len(ids) - 1
    out, i, j, state = [], 0, 0, None
    while i < T:
        n = min(chunks[j % len(chunks)], T - i)
        piece = [(0, ids[i:i + n])]
        batch = r.batch(piece)
        hidden = model(batch, r.caches)
        state = model.mtp_forward(model.mtp_input(hidden), torch.tensor(ids[i + 1:i + n + 1]), batch, r.caches)
        out.append(model.mtp_logits(state))
        r.advance(piece)
        i += n
        j += 1
    link = r.batch([(0, [chain_token])])  # position T: the lookahead (its main-layer forward never runs)
    state = model.mtp_forward(state[-1:], torch.tensor([chain_token]), link, r.caches)
    out.append(model.mtp_logits(state))
    return torch.cat(out)


@pytest.mark.parametrize("chunks", [[41], [5, 1, 3, 7]])
def test_mtp_pass_and_chain_match_the_reference(reference, mtp_model, chunks):
    """41 positions: past the window (8), across CSA (m = 4) compressions; chunks at every phase of both."""
    hf, own = reference
    g = torch.Generator().manual_seed(11)
    ids = [0] + torch.randint(2, 1024, (41,), generator=g).tolist()
    chain_token = 77
    want = _reference_mtp(hf, own, ids, chain_token)
    got = _ours(mtp_model, ids, chunks, chain_token)
    assert got.shape == want.shape == (42, 1024)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_mtp_input_must_be_the_last_forward(mtp_model):
    with pytest.raises(RuntimeError, match="not the last forward's output"):
        mtp_model.mtp_input(torch.zeros(3, 64))


@pytest.fixture(scope="module")
def off_run(tiny_dir):
    prompts = off_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = _engine(tiny_dir, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    return prompts, params, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kw", [{"max_num_batched_tokens": 13}, {"num_kv_blocks": 14},
                                {"speculative_adaptive": True}], ids=["chunked", "preempted", "adaptive"])
def test_engine_mtp_drafting_equals_off(tiny_dir, off_run, kw):
    """Greedy output with V4 MTP drafts (k = 3) equals speculation off: chunked prefill (13 tokens a step), a pool
    small enough to preempt, the adaptive scheduler; run twice (the second run's prompts hit the prefix cache,
    restoring the MTP layer's rings too). The random tiny model's MTP drafts are rarely right: this checks that
    drafting runs and rolls back cleanly, not acceptance."""
    prompts, params, want = off_run
    engine = _engine(tiny_dir, speculative_method="mtp", num_speculative_tokens=3, **{"num_kv_blocks": 256, **kw})
    assert len(engine.runner.model.mtp) == 1
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert got == want
    st = engine.stats()
    assert st.spec_drafted_tokens > 0 and st.kv_blocks_used == 0
    if "num_kv_blocks" in kw:
        assert st.num_preemptions > 0
    else:
        assert st.prefix_cache_hit_tokens > 0


def test_v4_mtp_refusals(tiny_dir):
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    with open(os.path.join(tiny_dir, "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers 0"):
        DeepseekV4ForCausalLM({**cfg, "num_nextn_predict_layers": 0}, CPUBackend(), torch.float32, load_mtp=True)
    L = cfg["num_hidden_layers"]
    short = {**cfg, "compress_ratios": cfg["compress_ratios"][:L]}
    with pytest.raises(ModelLoadError, match="compress_ratios schedules 0 MTP layers"):
        DeepseekV4ForCausalLM(short, CPUBackend(), torch.float32, load_mtp=True)
    with pytest.raises(ConfigError, match="context_parallel_size=2 with speculative decoding"):
        _engine(tiny_dir, speculative_method="mtp", context_parallel_size=2, num_kv_blocks=64)


def test_fp8_mtp_module_matches_its_dequantized_copy(tmp_path):
    """A V4 release stores the MTP block's linears and e_proj / h_proj in fp8 with 128x128 block scales: the fp8
    checkpoint's MTP logits (pass and chain) equal those of its dequantized copy in fp32."""
    from v4_helpers import load_ours, write_fp8_pair

    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    tensors = write_fp8_pair(str(fp8_dir), str(ref_dir))
    assert tensors["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    ids = [0] + torch.randint(2, 1024, (19,), generator=torch.Generator().manual_seed(5)).tolist()
    got, want = (_ours(load_ours(str(d), load_mtp=True), ids, [7, 5], 9) for d in (fp8_dir, ref_dir))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def _first_drafts(engine, prompt: list[int], request_id: str) -> tuple[list[int], list[float]]:
    """The MTP drafts (and confidences) made after the step that prefills `prompt` (then the request finishes)."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.step()
    (held,) = engine._spec.book.drafts.values()  # (the pipeline's book of drafts for the next step)
    while engine.has_unfinished_requests():
        engine.step()
    return held.tokens, held.confidence


def test_prefix_hit_restores_the_mtp_rings(tiny_dir):
    """A prompt run twice: the second prefills after a prefix-cache hit of whole blocks (the main and MTP layers'
    rings restored from the snapshots the first run's step and MTP pass took). Its first drafts and their
    confidences equal the first run's, which recomputed everything: the MTP pass there read the restored rings."""
    engine = _engine(tiny_dir, speculative_method="mtp", num_speculative_tokens=3, num_kv_blocks=64)
    prompt = [0] + torch.randint(2, 1024, (37,), generator=torch.Generator().manual_seed(8)).tolist()
    cold = _first_drafts(engine, prompt, "cold")
    hits = engine.stats().prefix_cache_hit_tokens
    warm = _first_drafts(engine, prompt, "warm")
    assert engine.stats().prefix_cache_hit_tokens - hits == 32  # 2 blocks of 16: positions 32..37 recomputed
    assert warm[0] == cold[0]
    torch.testing.assert_close(torch.tensor(warm[1]), torch.tensor(cold[1]), atol=1e-5, rtol=0)


def test_structured_requests_with_v4_mtp_drafts_equal_off_and_are_valid(tiny_dir):
    """A regex and a JSON Schema request beside a plain one: with V4 MTP drafts (drawn under each grammar's mask,
    spec/grammar_drafts.py) the tokens equal speculation off, and the texts satisfy their constraints."""
    import re

    import jsonschema

    from deepinfer import StructuredOutputsParams

    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
              "required": ["age", "tags"], "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)),
              SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=schema, whitespace="compact")),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    prompts = ["hello world", "a b c", "xyz"]
    off = [o.outputs[0] for o in _engine(tiny_dir, num_kv_blocks=128).generate(prompts, params, use_tqdm=False)]
    engine = _engine(tiny_dir, num_kv_blocks=128, speculative_method="mtp", num_speculative_tokens=3)
    on = [o.outputs[0] for o in engine.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert on[0].finish_reason == "stop" and re.fullmatch(regex, on[0].text), on[0].text
    assert on[1].finish_reason == "stop"
    jsonschema.validate(json.loads(on[1].text), schema)
    assert engine.stats().spec_drafted_tokens > 0 and engine._spec.num_grammar_masked > 0
