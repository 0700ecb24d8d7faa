"""The embedded default model (deepinfer/data/stdlib-coder): it loads from the package data, DeepInfer's greedy
output equals transformers' in fp32, and its MTP module's logits equal a reference built from transformers'
own DeepSeek-V3 decoder layer."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.nn.functional as F
from model_refs import dequantize_reference
from paged_batch_util import PagedKV
from safetensors.torch import load_file, save_file

from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.data import EMBEDDED_MODEL_FILES, EMBEDDED_MODEL_NAME, embedded_model_path
from deepinfer.models.registry import load_model

MODEL = embedded_model_path()
PROMPTS = ['def fib(n):\n    """Return the n-th Fibonacci number."""', "import os\nimport sys\n\n\ndef main(argv):"]


def _hf_weights() -> dict[str, torch.Tensor]:
    """The checkpoint with every fp8 weight dequantized by DeepSeek's formula (w * scale[i//128, j//128]),
    fp32. Why not transformers' own fp8 loading on the CPU: it dequantizes with a block size of
    rows // scale_rows, wrong for the partial 128-block of kv_a_proj_with_mqa (160 rows here), see
    tests/models/model_refs.py."""
    t = load_file(os.path.join(MODEL, "model.safetensors"))
    out = {}
    for name, w in t.items():
        if name.endswith("weight_scale_inv"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            w = dequantize_reference(w, t[name[: -len("weight")] + "weight_scale_inv"])
        out[name] = w.float().contiguous()
    return out


def _write_hf_copy(dst: str, tensors: dict[str, torch.Tensor], **config_changes) -> str:
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    cfg.update(torch_dtype="float32", **config_changes)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


@functools.lru_cache(maxsize=None)
def _hf(kind: str, root: str):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    w = _hf_weights()
    with open(os.path.join(MODEL, "config.json")) as f:
        L = json.load(f)["num_hidden_layers"]
    if kind == "main":
        path = _write_hf_copy(os.path.join(root, "main"), {k: v for k, v in w.items() if not
                                                            k.startswith(f"model.layers.{L}.")})
    else:
        # the MTP block as a one-layer transformers model: its decoder layer (renamed to layer 0, MoE like
        # the real one: first_k_dense_replace 0), its shared_head.norm as the final norm, the shared head
        prefix = f"model.layers.{L}."
        mtp = {"model.layers.0." + k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
        mtp = {k: v for k, v in mtp.items() if k.split(".")[3] not in ("enorm", "hnorm", "eh_proj", "shared_head")}
        mtp.update({"model.norm.weight": w[f"{prefix}shared_head.norm.weight"], "lm_head.weight": w["lm_head.weight"],
                    "model.embed_tokens.weight": w["model.embed_tokens.weight"]})
        path = _write_hf_copy(os.path.join(root, "mtp"), mtp, num_hidden_layers=1, first_k_dense_replace=0,
                              num_nextn_predict_layers=0)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval(), w, L


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("stdlib-coder-hf"))


@pytest.fixture(scope="module")
def ours():
    return load_model(MODEL, CPUBackend(), torch.float32, progress=False, load_mtp=True)


def test_embedded_model_ships_in_the_package_within_its_size_budget():
    assert os.path.isdir(MODEL) and os.path.basename(MODEL) == EMBEDDED_MODEL_NAME
    assert sorted(os.listdir(MODEL)) == sorted(EMBEDDED_MODEL_FILES)
    assert os.path.getsize(os.path.join(MODEL, "model.safetensors")) <= 16_000_000
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["topk_method"] == "noaux_tc"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    names = load_file(os.path.join(MODEL, "model.safetensors")).keys()
    L = cfg["num_hidden_layers"]
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "eh_proj.weight_scale_inv",
                 "shared_head.norm.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.{L}.{part}" in names, part


def test_loads_with_and_without_the_mtp_module(ours):
    assert len(ours.mtp) == 1 and ours.skipped_mtp_tensors == 0
    main_only = load_model(MODEL, CPUBackend(), torch.float32, progress=False)
    assert len(main_only.mtp) == 0 and main_only.skipped_mtp_tensors > 0
    assert [s.layer_ids for s in ours.kv_cache_specs(include_mtp=True)] == [tuple(range(ours.num_layers + 1))]
    assert [s.layer_ids for s in main_only.kv_cache_specs()] == [tuple(range(ours.num_layers))]


def test_greedy_equals_transformers_fp32(hf_root):
    from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

    hf, _, _ = _hf("main", hf_root)
    engine = DeepInferenceEngine(EngineConfig(device="cpu", dtype="float32", load_progress=False))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        n = len(out.prompt_token_ids)
        for j, tok in enumerate(out.outputs[0].token_ids):
            row = ref[n - 1 + j]
            # our greedy token is transformers' argmax (or within fp32 noise of a tie)
            assert row[tok] >= row.max() - 1e-4, (j, tok, row.argmax().item())
        assert sum(int(ref[n - 1 + j].argmax() == t) for j, t in enumerate(out.outputs[0].token_ids)) >= 23


def test_prefill_logits_equal_transformers_fp32(ours, hf_root):
    hf, _, _ = _hf("main", hf_root)
    from deepinfer.text.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(MODEL).encode(PROMPTS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = PagedKV(ours).step([(0, ids)])
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_logits_equal_a_transformers_reference(ours, hf_root):
    """Ours: DeepseekMTP over the paged cache (in two chunks, so its own KV is read back). Reference:
    transformers' main model for h, then eh_proj([enorm(embed(t+1)); hnorm(h)]) by hand and transformers'
    DeepSeek-V3 decoder layer + norm + head (the one-layer model above) on that, as inputs_embeds."""
    from deepinfer.text.tokenizer import Tokenizer

    hf_main, w, L = _hf("main", hf_root)
    hf_mtp, _, _ = _hf("mtp", hf_root)
    ids = Tokenizer.from_pretrained(MODEL).encode(PROMPTS[1] + "\n    parser = argparse.ArgumentParser()")
    p = f"model.layers.{L}."
    with torch.no_grad():
        h = hf_main.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
        e = w["model.embed_tokens.weight"][torch.tensor(ids[1:])]
        x0 = F.linear(torch.cat([_rms(e, w[p + "enorm.weight"]), _rms(h[:-1], w[p + "hnorm.weight"])], -1),
                      w[p + "eh_proj.weight"])
        ref = hf_mtp(inputs_embeds=x0[None]).logits[0].float()

    kv = PagedKV(ours, specs=ours.kv_cache_specs(include_mtp=True))
    with torch.no_grad():
        main_batch = kv.batch([(0, ids)])
        hidden = ours.forward(main_batch, kv.caches)
        cut = len(ids) // 2
        got = []
        for lo, hi in ((0, cut), (cut, len(ids) - 1)):  # the MTP sequence: token i+1 at position i
            b = kv.batch([(1, ids[lo + 1: hi + 1])])
            got.append(ours.mtp_logits(ours.mtp_forward(hidden[lo:hi], b.input_ids, b, kv.caches)))
        got = torch.cat(got)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    # the draft is a real prediction: it agrees with the main model's own next-next token mostly
    main_next_next = ours.compute_logits(hidden)[1:].argmax(-1)
    assert (got.argmax(-1) == main_next_next).float().mean() > 0.5


def test_load_mtp_is_refused_for_a_checkpoint_without_one(tmp_path):
    from deepinfer.checkpoints import make_checkpoint
    from deepinfer.errors import ModelLoadError

    make_checkpoint("tiny-v3", str(tmp_path), seed=0)
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers"):
        load_model(str(tmp_path), CPUBackend(), torch.float32, progress=False, load_mtp=True)
