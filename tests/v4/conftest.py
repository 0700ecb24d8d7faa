"""V4 test fixtures: one tiny-v4 checkpoint, its HF reference and our model, built once per session."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # the tiny V4 model is hundreds of small ops per step; on a shared 2-core box one thread is ~10x faster
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from deepinfer.checkpoints import make_checkpoint

    path = str(tmp_path_factory.mktemp("tiny_v4"))
    make_checkpoint("tiny-v4", path, seed=0)  # config.json + safetensors + tokenizer, as the CLI writes it
    return path


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    pytest.importorskip("transformers", minversion="5.24")
    from v4_helpers import load_hf

    return load_hf(tiny_dir)


@pytest.fixture(scope="session")
def our_model(tiny_dir):
    from v4_helpers import load_ours

    return load_ours(tiny_dir)
