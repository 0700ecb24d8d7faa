"""tools/stdlib_coder/v4_model.py, the trainer of stdlib-coder-v4: what it exports is what it trained. Its training
forward (transformers' V4 blocks, the MTP block fed as DeepSeek's MTPBlock.forward) and deepinfer's V4 model loaded
from the exported checkpoint give the same main and MTP logits, so the acceptance measured in the engine is the
trained module's. Perturbed weights (a fresh init's near-zero projections would compare nothing)."""

from __future__ import annotations

import os

import pytest
import torch

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "deepinfer", "data", "stdlib-coder")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("transformers", minversion="5.24")
    from tools.stdlib_coder.v4_model import TrainingV4, stdlib_v4_config

    trainer = TrainingV4(stdlib_v4_config(vocab_size=4107), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    out = str(tmp_path_factory.mktemp("stdlib_v4"))
    trainer.export(out, TOKENIZER)
    return trainer.eval(), out


def test_export_names_are_deepseeks_and_the_tokenizer_travels(exported):
    from safetensors.torch import load_file

    from deepinfer.checkpoints.presets_v4 import v4_tensor_plan

    trainer, out = exported
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert names == {s.name for s in v4_tensor_plan(trainer.cfg, False)}  # the preset writer's names, no more or less
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(os.listdir(out))


@torch.no_grad()
def test_engine_model_gives_the_trainers_main_and_mtp_logits(exported):
    from v4_helpers import PagedRunner, load_ours

    trainer, out = exported
    ours = load_ours(out, load_mtp=True)
    g = torch.Generator().manual_seed(5)
    # 40 positions: past the 32-token window, across CSA (m = 4) and HCA (m = 16) compressions
    tokens = [0] + torch.randint(2, 4096, (40,), generator=g).tolist()
    main_ref, mtp_ref = trainer.forward_logits(torch.tensor([tokens]))
    r = PagedRunner(ours, specs=ours.kv_cache_specs(include_mtp=True))
    r.add(0)
    main, mtp, i = [], [], 0
    T = len(tokens) - 1
    for n in (7, 1, 13, 9, 10):  # chunks at several phases of m = 4 and 16
        piece = [(0, tokens[i:i + n])]
        batch = r.batch(piece)
        hidden = ours(batch, r.caches)
        main.append(ours.compute_logits(hidden))
        state = ours.mtp_forward(ours.mtp_input(hidden), torch.tensor(tokens[i + 1:i + n + 1]), batch, r.caches)
        mtp.append(ours.mtp_logits(state))
        r.advance(piece)
        i += n
    assert i == T
    torch.testing.assert_close(torch.cat(main), main_ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(mtp), mtp_ref[0], rtol=1e-4, atol=1e-4)
