"""Shared fixtures for tests/engine: one small tokenizer per session (the checkpoints: tests/conftest.py)."""

from __future__ import annotations

import pytest

from deepinfer.checkpoints.tokenizer_factory import write_tokenizer


@pytest.fixture(scope="session")
def fake_tokenizer_dir(tmp_path_factory):
    """A tokenizer for the arithmetic fake model (vocab 300 = engine_fakes.VOCAB)."""
    d = tmp_path_factory.mktemp("fake_tok")
    write_tokenizer(str(d), 300)
    return str(d)


@pytest.fixture(scope="session")
def hf_reference(checkpoint, tmp_path_factory):
    """hf_reference(preset) -> transformers model in fp32 (fp8 checkpoints dequantized into an fp32 copy)."""
    import json
    import os

    import torch

    made: dict[str, object] = {}

    def dequantized(src: str) -> str:
        from safetensors.torch import load_file, save_file

        dst = str(tmp_path_factory.mktemp("dequant"))
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = "float32"
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
        tensors = {}
        for name in sorted(os.listdir(src)):
            if name.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(src, name)))
        out = {}
        for name, t in tensors.items():
            if name.endswith("weight_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:  # each 128x128 block times its scale (DeepSeek's format)
                s = tensors[name + "_scale_inv"]
                full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
                t = t.to(torch.float32) * full
            out[name] = t.to(torch.float32).contiguous()
        save_file(out, os.path.join(dst, "model.safetensors"))
        return dst

    def get(preset: str):
        if preset not in made:
            import transformers
            from transformers import AutoModelForCausalLM

            transformers.logging.set_verbosity_error()
            path = checkpoint(preset)
            if preset.endswith("fp8"):
                path = dequantized(path)
            made[preset] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return made[preset]

    return get
