"""Loading a deepseek_v4 checkpoint: MTP tensors kept aside, name variants, and errors that name the tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.errors import ModelLoadError
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.loader import iter_checkpoint


def _tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    return list(iter_checkpoint(path, progress=False))


def _fresh(path: str) -> DeepseekV4ForCausalLM:
    with open(os.path.join(path, "config.json")) as f:
        return DeepseekV4ForCausalLM(json.load(f), CPUBackend(), torch.float32)


def test_mtp_weights_are_kept_aside(our_model):
    mtp = our_model.mtp_weights
    assert "mtp.0.attn.wq_a.weight" in mtp and "mtp.0.ffn.experts.0.w1.weight" in mtp and "mtp.0.e_proj.weight" in mtp
    assert not any(k.startswith("layers.") for k in mtp)


def test_transformers_style_names_are_accepted(tiny_dir, our_model):
    alias = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
             "hc_head_fn": "model.hc_head.hc_fn", "norm.weight": "model.norm.weight"}
    model = _fresh(tiny_dir)
    model.load_weights((alias.get(n, "model." + n), t) for n, t in _tensors(tiny_dir))
    model.finalize()
    assert torch.equal(model.embed.weight, our_model.embed.weight)
    assert torch.equal(model.hc_head.hc_fn, our_model.hc_head.hc_fn)


def test_unexpected_missing_and_misshaped_tensors_are_named(tiny_dir):
    tensors = _tensors(tiny_dir)
    model = _fresh(tiny_dir)
    with pytest.raises(ModelLoadError, match="layers.0.attn.bogus.weight"):
        model.load_weights([("layers.0.attn.bogus.weight", torch.zeros(1))])
    model = _fresh(tiny_dir)
    model.load_weights(t for t in tensors if t[0] != "layers.1.attn.compressor.ape")
    with pytest.raises(ModelLoadError, match="layers.1.attn.compressor.ape"):
        model.finalize()
    model = _fresh(tiny_dir)
    with pytest.raises(ModelLoadError, match="layers.0.ffn.gate.tid2eid"):
        model.load_weights([("layers.0.ffn.gate.tid2eid", torch.full((1024, 2), 99))])


def test_a_checkpoint_saved_by_transformers_loads_and_matches(tmp_path, hf_model, our_model):
    """save_pretrained writes its own config.json (layer_types, nested rope_parameters) and mixed names."""
    from v4_helpers import load_ours, run_chunks

    hf_model.save_pretrained(str(tmp_path))
    model = load_ours(str(tmp_path))
    assert model.config.layer_types == our_model.config.layer_types
    assert model.config.rope_compress == our_model.config.rope_compress
    ids = list(range(3, 40))
    torch.testing.assert_close(run_chunks(model, ids, [40]), run_chunks(our_model, ids, [40]), atol=1e-6, rtol=0)
