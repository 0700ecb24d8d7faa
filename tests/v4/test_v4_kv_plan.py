"""KV planning for V4's compressed groups: a sequence holds whole blocks in every group.

With block size 16 an HCA block (m=16) covers 256 tokens, so a planner that only
sizes groups for a token capacity gives the HCA group 4 blocks out of
num_kv_blocks=64 and short sequences get preempted although the cache has room.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams
from deepinfer.checkpoints.presets_v4 import tiny_v4_config
from deepinfer.errors import DeepInferError
from deepinfer.kv.manager import KVCacheManager
from deepinfer.kv.planner import plan_kv_cache
from deepinfer.models.deepseek_v4.config import parse_v4_config
from deepinfer.models.deepseek_v4.model import v4_kv_cache_specs

LENGTHS = [1, 3, 5, 8, 9, 16, 17, 33, 47]
MAX_TOKENS = 12
BS = 16


def _specs():
    return v4_kv_cache_specs(parse_v4_config(tiny_v4_config()), torch.float32)


class _Seq:
    def __init__(self, seq_id: str, n: int):
        self.seq_id, self.num_computed_tokens = seq_id, n


def _grow(kv: KVCacheManager, seq: _Seq, n: int, chunk: int) -> bool:
    """Cache n more tokens in chunks as the engine does (sliding blocks trimmed between steps)."""
    while n > 0:
        c = min(chunk, n)
        if not kv.can_allocate(seq, c):
            return False
        kv.allocate(seq, c)
        seq.num_computed_tokens += c
        kv.trim(seq)
        n -= c
    return True


@pytest.mark.parametrize("max_num_seqs", [9, 256])
def test_nine_short_tiny_v4_sequences_fit_in_64_blocks(max_num_seqs):
    specs = _specs()
    plan = plan_kv_cache(specs, BS, max_num_seqs, 96, 32, num_kv_blocks=64)
    kv = KVCacheManager(specs, plan.num_blocks, BS, max_num_seqs, 96)
    seqs = [_Seq(f"s{i}", 0) for i in range(len(LENGTHS))]
    for seq, n in zip(seqs, LENGTHS):  # every prompt, then every decode step, all sequences resident
        assert _grow(kv, seq, n, 32), f"prompt {seq.seq_id} ({n} tokens) does not fit: {plan}"
    for _ in range(MAX_TOKENS):
        for seq in seqs:
            assert _grow(kv, seq, 1, 1), f"{seq.seq_id} at {seq.num_computed_tokens} tokens does not fit: {plan}"
    assert sum(s.num_computed_tokens for s in seqs) <= plan.capacity_tokens == min(64 * BS, max_num_seqs * 96)


@pytest.mark.parametrize("num_kv_blocks", [1, 7, 64, 300])
def test_any_max_num_seqs_sequences_within_the_capacity_fit_every_compressed_group(num_kv_blocks):
    """The worst case for a compressed group of rate m: every sequence just past a block boundary
    (k * block_size + 1 entries), as many sequences as allowed, total tokens up to the capacity."""
    specs, S, max_len = _specs(), 12, 4096
    plan = plan_kv_cache(specs, BS, S, max_len, 32, num_kv_blocks=num_kv_blocks)
    cap = plan.capacity_tokens
    for spec in specs:
        if spec.tokens_per_entry == 1:
            continue
        m = spec.tokens_per_entry
        for per_seq_blocks in (1, 2, 5):
            tokens = ((per_seq_blocks - 1) * BS + 1) * m
            n = min(S, cap // tokens)
            if n == 0:
                continue
            rest = cap - n * tokens  # the leftover tokens go to the first sequence
            held = per_seq_blocks * n + (rest // m) // BS
            assert held <= plan.num_blocks[spec.name], (spec.name, per_seq_blocks, plan)


def test_budget_plan_stays_within_budget_and_refuses_fewer_than_max_num_seqs_minimal_sequences():
    specs = _specs()
    plan = plan_kv_cache(specs, BS, 16, 4096, 64, budget_bytes=4 << 20)
    assert plan.bytes_total <= 4 << 20
    assert all(plan.num_blocks[s.name] >= 16 for s in specs if s.tokens_per_entry > 1)
    # the least a budget must hold: 64 state rows, one block per sequence in each compressed group,
    # one block of the sliding group
    minimum = sum(64 * s.state_bytes_per_seq() for s in specs)
    minimum += sum((64 if s.tokens_per_entry > 1 else 1) * BS * s.bytes_per_entry() for s in specs)
    plan = plan_kv_cache(specs, BS, 64, 4096, 64, budget_bytes=minimum)
    assert plan.bytes_total == minimum
    with pytest.raises(DeepInferError, match=r"cannot hold max_num_seqs=64 minimal sequences"):
        plan_kv_cache(specs, BS, 64, 4096, 64, budget_bytes=minimum - 1)


def test_engine_runs_nine_short_sequences_without_preemption(tiny_dir):
    engine = DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=tiny_dir, device="cpu", dtype="float32", max_model_len=96,
                     max_num_batched_tokens=32, num_kv_blocks=64, load_progress=False))
    g = torch.Generator().manual_seed(3)
    prompts = [[0] + torch.randint(2, 1024, (n - 1,), generator=g).tolist() for n in LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    st = engine.stats()
    assert st.num_preemptions == 0, engine.kv_plan
    assert st.kv_blocks_used == 0
