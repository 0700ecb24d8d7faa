"""The runtime's seams to a backend, exercised on the CPU with honest stand-ins:

- the KV cache layout is the backend's: a backend that splits MLA's latent and rope parts gets
  them as two tensors everywhere (allocation, the profiling forward, the model, the op) and the
  engine generates the same tokens;
- decode graphs are the backend's: the contract's bucketed DecodeGraphRunner, driven through a
  stand-in graph API that re-runs the captured function on the static buffers, pads and replays
  exactly as a real graph would, and changes no token;
- the models call the communicator at the row-parallel points (identity in one process);
- the batch builder's device mirror of the block tables stays equal to the KV manager's tables
  when only the changed entries are applied.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import pytest
import torch
from stand_in_graphs import StandInGraphRunner

from deepinfer import EngineConfig, SamplingParams
from deepinfer.backend import (
    PROCESS_GROUP_NAMES,
    BackendCaps,
    KVCacheSpec,
    KVLayout,
    SingleProcessCommunicator,
)
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.engine import DeepInferenceEngine
from deepinfer.kv.manager import KVCacheManager
from deepinfer.models.base import CausalLM
from deepinfer.models.registry import load_model
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.worker.batch_builder import BatchBuilder

VOCAB = 300  # the fake tokenizer's (tests/engine/conftest.py)
PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 41, 7], [11, 3, 250], list(range(20, 60))]


def _engine(path: str, backend, **kw) -> DeepInferenceEngine:
    cfg = EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64,
                       **kw)
    model = load_model(path, backend, torch.float32, progress=False)
    return DeepInferenceEngine.from_components(cfg, model, Tokenizer.from_pretrained(path), backend)


def _greedy(engine: DeepInferenceEngine, n: int = 12) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


class SplitLayoutBackend(CPUBackend):
    """Keeps an MLA group's entries as two tensors, the latent part and the rope part, as the model
    declares them (KVCacheSpec.components)."""

    name = "cpu-split-kv"

    def kv_cache_layout(self, spec: KVCacheSpec) -> KVLayout:
        return KVLayout.split_components(spec) if spec.components else super().kv_cache_layout(spec)


def test_split_kv_layout_is_used_end_to_end_and_changes_no_token(checkpoint):
    path = checkpoint("tiny-v2-lite")
    base = _greedy(_engine(path, CPUBackend()))
    engine = _engine(path, SplitLayoutBackend())
    caches = engine.runner.caches
    parts = caches.get("mla", 0)
    assert isinstance(parts, tuple) and len(parts) == 2, "the backend's layout was not used"
    assert parts[0].shape[-1] + parts[1].shape[-1] == caches.specs["mla"].entry_shape[-1]
    assert _greedy(engine) == base
    assert bool(parts[1].abs().sum() > 0), "nothing was written into the rope part"


def test_split_layout_plans_from_the_layout_bytes():
    from deepinfer.kv.planner import plan_kv_cache

    spec = KVCacheSpec("mla", (0, 1), (40,), torch.float32)
    padded = KVLayout.split_last(spec, (32, 8), ("latent", "rope"))
    wide = KVLayout((*padded.parts, padded.parts[1]))  # a layout that stores 8 more values per entry
    one = plan_kv_cache([spec], 16, 4, 64, 32, budget_bytes=40 * 4 * 2 * 16 * 10)
    assert one.num_blocks["mla"] == 10
    assert plan_kv_cache([spec], 16, 4, 64, 32, budget_bytes=40 * 4 * 2 * 16 * 10,
                         layouts={"mla": padded}).num_blocks["mla"] == 10
    assert plan_kv_cache([spec], 16, 4, 64, 32, budget_bytes=40 * 4 * 2 * 16 * 10,
                         layouts={"mla": wide}).num_blocks["mla"] == 8  # 48 values per entry: 400 // 48




class AnyModelCPU(CPUBackend):
    """The cpu backend without its model_type list (the fake models here are no DeepSeek family)."""

    name = "cpu-any-model"

    @property
    def caps(self) -> BackendCaps:
        return replace(super().caps, model_types=())


class GraphBackend(AnyModelCPU):
    name = "cpu-graphs"

    @property
    def caps(self) -> BackendCaps:
        return replace(super().caps, graph_capture=True)

    def make_graph_runner(self, model, caches, block_size, max_model_len, max_num_seqs):
        return StandInGraphRunner.capture(model, caches, block_size, max_model_len, max_num_seqs, self.device,
                                          buckets=[1, 2, 4])


class GraphSafeModel(CausalLM):
    """A model whose forward reads only device tensors (no host lists), as captured graphs require:
    each token's id goes to its KV slot (slot -1 skipped), and its hidden value is the sum of the ids
    cached for its sequence (block table + seq_lens) plus 3 x its position, mod the vocabulary. A padded
    row that wrote anywhere, or read a real sequence's entries, would change the tokens."""

    model_type = "graph-safe-fake"
    quantization = None

    def __init__(self):
        super().__init__(config={}, backend=None, dtype=torch.float32)
        self.vocab_size = VOCAB
        self.max_position_embeddings = 512

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [KVCacheSpec("full", (0,), (1,), torch.float32)]

    def load_weights(self, weights) -> None:
        return None

    def finalize(self) -> None:
        return None

    def forward(self, batch, caches) -> torch.Tensor:
        cache = caches.get("full", 0)
        flat = cache.view(-1)
        slots = batch.slot_mapping["full"]
        flat.index_put_((slots.clamp(min=0),), torch.where(slots >= 0, batch.input_ids.float(), flat[slots.clamp(min=0)]))
        table = batch.block_tables["full"].long()
        bs = cache.shape[1]
        j = torch.arange(table.shape[1] * bs)
        vals = cache[table[:, j // bs].clamp(min=0), j % bs, 0]  # [B, J]
        seq_of_token = torch.repeat_interleave(torch.arange(table.shape[0]), batch.query_start_loc.diff().long())
        seen = j[None, :] <= batch.positions[:, None]  # causal: a token sees the entries up to its own
        sums = (vals[seq_of_token] * seen).sum(-1)
        return ((sums + 3 * batch.positions) % VOCAB).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], VOCAB)
        logits.scatter_(1, hidden.long(), 10.0)
        return logits


def _fake_engine(tok_dir: str, backend, **kw) -> DeepInferenceEngine:
    cfg = EngineConfig(model_name_or_path=tok_dir, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=64,
                       **kw)
    return DeepInferenceEngine.from_components(cfg, GraphSafeModel(), Tokenizer.from_pretrained(tok_dir), backend)


def test_decode_graph_runner_pads_and_replays_without_changing_tokens(fake_tokenizer_dir):
    prompts = [[5, 9, 17, 33, 2, 8, 100, 41, 7], [11, 3, 250], list(range(20, 60))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(engine):
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    eager = run(_fake_engine(fake_tokenizer_dir, AnyModelCPU(), max_num_seqs=4))
    engine = _fake_engine(fake_tokenizer_dir, GraphBackend(), max_num_seqs=4)
    runner = engine.runner.graph_runner
    assert isinstance(runner, StandInGraphRunner) and sorted(runner.graphs) == [1, 2, 4]
    assert run(engine) == eager
    assert len({t for out in eager for t in out}) > 5  # the outputs depend on the cached context
    replays = {b: g["replays"] for b, g in runner.graphs.items()}
    assert replays[4] > 0, replays  # three sequences decode in the bucket of four: one padding row


def test_a_backend_that_declares_graphs_must_supply_a_runner(checkpoint):
    class NoRunner(GraphBackend):
        def make_graph_runner(self, *args):
            return None

    from deepinfer.errors import BackendError

    with pytest.raises(BackendError, match="make_graph_runner returned no graph runner"):
        _engine(checkpoint("tiny-v2-lite"), NoRunner())


class CountingCommunicator(SingleProcessCommunicator):
    def __init__(self):
        self.calls: Counter = Counter()

    def all_reduce(self, x):
        self.calls["all_reduce"] += 1
        return super().all_reduce(x)

    def all_gather(self, x, dim=0):
        self.calls["all_gather"] += 1
        return super().all_gather(x, dim)


class CommBackend(CPUBackend):
    """Counts the collectives the model calls over each group, through the engine's own seam:
    install_communicators, then Backend.communicator(group) as every model layer asks for it."""

    name = "cpu-comm"

    def __init__(self):
        super().__init__()
        self.comms = {group: CountingCommunicator() for group in PROCESS_GROUP_NAMES}
        self.install_communicators(self.comms)


def test_models_call_the_communicator_at_the_row_parallel_points(checkpoint):
    path = checkpoint("tiny-v2-lite")
    backend = CommBackend()
    model = load_model(path, backend, torch.float32, progress=False)
    layers = model.num_layers
    from deepinfer.backend import ForwardBatch, KVCaches

    specs = model.kv_cache_specs()
    caches = KVCaches.allocate(specs, {s.name: 4 for s in specs}, 16, 1, backend.device)
    batch = ForwardBatch(
        input_ids=torch.tensor([3, 4, 5]), positions=torch.arange(3), query_start_loc=torch.tensor([0, 3]),
        seq_lens=torch.tensor([3]), context_lens=torch.tensor([0]),
        block_tables={s.name: torch.tensor([[0]], dtype=torch.int32) for s in specs},
        slot_mapping={s.name: torch.arange(3) for s in specs}, logits_indices=torch.tensor([2]),
        query_lens_cpu=[3], seq_lens_cpu=[3], context_lens_cpu=[0], block_size=16,
    )
    with torch.inference_mode():
        hidden = model.forward(batch, caches)
        model.compute_logits(hidden[batch.logits_indices])
    # per layer over "tp": attention's o_proj and the MLP / MoE output (shared experts folded into the MoE's one
    # reduce), and the vocab-parallel logits gathered once; "dp" and "ep" are groups of one without a layout
    assert backend.comms["tp"].calls == Counter({"all_reduce": 2 * layers, "all_gather": 1})


def test_device_mirror_of_block_tables_follows_only_the_changes():
    specs = [KVCacheSpec("full", (0,), (4,), torch.float32),
             KVCacheSpec("swa", (1,), (4,), torch.float32, sliding_window=6)]
    kv = KVCacheManager(specs, {"full": 64, "swa": 64}, 4, 6, 128)
    builder = BatchBuilder(kv, torch.device("cpu"), separate_mirror=True)

    @dataclass
    class Seq:
        seq_id: str
        num_computed_tokens: int = 0

    seqs = [Seq(f"s{i}") for i in range(5)]
    g = torch.Generator().manual_seed(1)
    changed_steps = 0
    for step in range(60):
        for s in seqs:
            n = int(torch.randint(1, 6, (1,), generator=g))
            if kv.can_allocate(s, n):
                kv.allocate(s, n)
                s.num_computed_tokens += n
                kv.trim(s)
        if step % 9 == 4:
            victim = seqs[step % len(seqs)]
            kv.free(victim)
            victim.num_computed_tokens = 0
        pending = kv.take_table_changes()
        changed_steps += bool(pending)
        for group, ranges in pending.items():  # give them back for the builder (take is destructive)
            kv._changes[group].extend(ranges)
        builder.sync_tables()
        for name in kv.block_tables:
            assert torch.equal(builder.mirror[name], kv.block_tables[name]), (step, name)
        assert kv.take_table_changes() == {}  # the builder took them all
    assert changed_steps > 10


def test_static_inputs_pad_what_earlier_steps_filled_and_nothing_else(monkeypatch):
    """StaticInputs.load (backend/graph_runner.py): after any sequence of loads (batch sizes up and down, buckets up
    and down) every row a bucket's graph reads past the batch is padding (ids, positions and lengths 0, KV slots -1),
    exactly as if every load reset them; steps of one size in a row launch no reset."""
    from deepinfer.backend import ForwardBatch, StaticInputs

    st = StaticInputs.allocate(8, 3, ["mla"], torch.device("cpu"))

    def batch(b: int, base: int) -> ForwardBatch:
        v = torch.arange(base, base + b, dtype=torch.int64)
        return ForwardBatch(input_ids=v, positions=v + 1, query_start_loc=torch.arange(b + 1, dtype=torch.int32),
                            seq_lens=(v + 2).int(), context_lens=(v + 1).int(),
                            block_tables={"mla": torch.full((b, 2), 7, dtype=torch.int32)},
                            slot_mapping={"mla": v + 100}, logits_indices=torch.arange(b), query_lens_cpu=[1] * b,
                            seq_lens_cpu=[1] * b, context_lens_cpu=[0] * b, state_slots=None, state_slots_cpu=[],
                            block_size=16)

    resets: list[int] = []
    zero_, fill_ = torch.Tensor.zero_, torch.Tensor.fill_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: (resets.append(1), zero_(t))[1])
    monkeypatch.setattr(torch.Tensor, "fill_", lambda t, v: (resets.append(1), fill_(t, v))[1])
    for step, (b, size) in enumerate([(3, 4), (3, 4), (1, 2), (2, 8), (6, 8), (2, 4), (1, 1), (5, 8), (5, 8)]):
        before = (st.input_ids.clone(), st.used)
        resets.clear()
        st.load(batch(b, 10 * (step + 1)), size, ["mla"])
        base = 10 * (step + 1)
        assert st.input_ids[:b].tolist() == list(range(base, base + b))
        assert st.slot_mapping["mla"][:b].tolist() == list(range(base + 100, base + 100 + b))
        # the rows this bucket pads
        assert st.input_ids[b:size].tolist() == [0] * (size - b) and st.positions[b:size].tolist() == [0] * (size - b)
        pad = [0] * (size - b)
        assert st.seq_lens[b:size].tolist() == pad and st.context_lens[b:size].tolist() == pad
        assert st.slot_mapping["mla"][b:size].tolist() == [-1] * (size - b)
        # rows past the bucket keep what they held; `used` covers every row that holds a real row's values
        assert st.input_ids[size:].tolist() == before[0][size:].tolist()
        held = [i for i in range(8) if st.slot_mapping["mla"][i] != -1]
        assert all(i < st.used for i in held), (held, st.used)
        if step == 1 or step == 8:  # the same batch size as the step before: nothing reset
            assert resets == [] and st.used == b
        if step == 2:  # rows 1 of bucket 2 held step 1's row: reset (5 tensors)
            assert len(resets) == 5
