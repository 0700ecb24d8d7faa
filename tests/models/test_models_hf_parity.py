"""DeepInfer's V2/V3 models on the CPU backend vs Hugging Face transformers (fp32), same checkpoint.

Prefill logits of a batch of prompts of different lengths, then chunked
prefill + token-by-token decode over the paged latent cache, both against the
reference's full forward.
"""

from __future__ import annotations

import pytest
import torch
from model_refs import TINY_PRESETS, hf_logits, hf_model, our_model, prompts
from paged_batch_util import PagedKV

ATOL = RTOL = 1e-4


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_hf_loads_checkpoint_without_missing_or_unexpected_keys(preset):
    _, info = hf_model(preset)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_prefill_logits_match_hf(preset):
    model = our_model(preset)
    batch = prompts(model.vocab_size, [1, 7, 19, 40, 130], seed=1)
    kv = PagedKV(model, num_blocks=32)
    logits = kv.step([(i, p) for i, p in enumerate(batch)])
    assert logits.dtype == torch.float32 and logits.shape == (sum(map(len, batch)), model.vocab_size)
    off = 0
    for p in batch:
        ref = hf_logits(preset, p)
        torch.testing.assert_close(logits[off : off + len(p)], ref, atol=ATOL, rtol=RTOL)
        off += len(p)
    # the reference logits are not degenerate (random weights with a useful spread)
    assert ref.std() > 0.5 and (ref.softmax(-1).max(-1).values < 0.99).all()


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_chunked_prefill_then_decode_matches_full_forward(preset):
    model = our_model(preset)
    a, b, c = prompts(model.vocab_size, [45, 30, 20], seed=2)
    ref = {0: hf_logits(preset, a), 1: hf_logits(preset, b), 2: hf_logits(preset, c)}
    seqs = {0: a, 1: b, 2: c}
    kv = PagedKV(model, num_blocks=24, seed=3)
    done = {0: 0, 1: 0, 2: 0}

    def run(chunks):
        out = kv.step([(s, seqs[s][done[s] : done[s] + n]) for s, n in chunks])
        off = 0
        for s, n in chunks:
            torch.testing.assert_close(out[off : off + n], ref[s][done[s] : done[s] + n], atol=ATOL, rtol=RTOL)
            off += n
            done[s] += n

    run([(0, 10), (1, 17)])  # two prefills, one ending mid-block
    run([(0, 9), (1, 1)])  # chunked prefill on a cached prefix, next to a decode
    run([(2, 20), (1, 1)])  # a new prompt joins while another decodes
    while done[0] < len(a) or done[1] < len(b) or done[2] < len(c):
        run([(s, 1) for s in (0, 1, 2) if done[s] < len(seqs[s])])  # pure decode steps (absorbed path)


def test_bf16_model_tracks_fp32():
    """The bf16 model is the same math: its logits stay close to fp32 ones (argmax may differ on near-ties)."""
    fp32, bf16 = our_model("tiny-v3"), our_model("tiny-v3", torch.bfloat16)
    (p,) = prompts(fp32.vocab_size, [24], seed=4)
    a = PagedKV(fp32).step([(0, p)])
    b = PagedKV(bf16).step([(0, p)])
    assert b.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    # most rows agree to bf16 precision; a row whose top-k expert choice flips in bf16 moves more
    assert cos.median() > 0.999 and cos.min() > 0.9


@pytest.mark.parametrize(
    "preset,changes",
    [
        ("tiny-v3", {"rope_interleave": False}),  # V3 without interleaved rope pairs (HF rotate_half)
        ("tiny-v2", {"attention_bias": True}),  # biases on q_a_proj / kv_a_proj_with_mqa / o_proj
        ("tiny-v2-lite", {"attention_bias": True, "tie_word_embeddings": True}),
        ("tiny-v3", {"rope_scaling": None}),  # plain RoPE, no YaRN softmax correction
    ],
    ids=["v3-no-interleave", "v2-attention-bias", "v2lite-bias-tied", "v3-no-yarn"],
)
def test_config_variants_match_hf(preset, changes):
    import transformers
    from model_refs import variant_checkpoint
    from transformers import AutoModelForCausalLM

    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.models.registry import load_model

    name = "-".join(f"{k}={v}" for k, v in changes.items())
    path = variant_checkpoint(preset, name, **changes)
    transformers.logging.set_verbosity_error()
    ref, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model = load_model(path, CPUBackend(), torch.float32, progress=False)
    batch = prompts(model.vocab_size, [5, 33], seed=6)
    kv = PagedKV(model)
    out = kv.step([(i, p) for i, p in enumerate(batch)])
    off = 0
    for p in batch:
        with torch.no_grad():
            r = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(out[off : off + len(p)], r, atol=ATOL, rtol=RTOL)
        off += len(p)
    # one decode step on top of the cache
    nxt = [int(out[len(batch[0]) - 1].argmax()), int(out[-1].argmax())]
    dec = kv.step([(0, [nxt[0]]), (1, [nxt[1]])])
    for i, p in enumerate(batch):
        with torch.no_grad():
            r = ref(torch.tensor([p + [nxt[i]]])).logits[0, -1]
        torch.testing.assert_close(dec[i], r, atol=ATOL, rtol=RTOL)
