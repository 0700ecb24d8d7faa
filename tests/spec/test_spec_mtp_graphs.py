"""The MTP drafter's graphs (backend/mtp_graph_runner.py) on the nvidia backend under the Triton interpreter, over the
stand-in graph API of test_spec_nvidia_interpreter.py (a replay re-runs the captured function on the static inputs):
drafts and confidences replayed == the eager drafter's, the MTP KV they write == the eager one's (and nothing past
a chain's end), at several bucket sizes with padded rows; an engine drafting from graphs == speculation off; the
drafting-cost table timed by replays. Tiny shapes: the one-layer drafting checkpoint of that module, fp32."""

from __future__ import annotations

import pytest
import torch
from stand_in_graphs import StandInGraphRunner
from test_spec_nvidia_interpreter import (
    ALPHA,
    DEVICE,
    GREEDY,
    TINY,
    GraphNvidiaBackend,
    make,
    make_drafting_checkpoint,
    prompts,
    replays,
    run,
)

from deepinfer.backend import KVCaches, MTPGraphRunner
from deepinfer.models.registry import load_model
from deepinfer.spec.mtp_drafter import MTPDrafter, MTPRows
from deepinfer.text.tokenizer import Tokenizer

BS = 4  # small blocks: a chain's lookahead lands inside allocated blocks, so a stray write would show


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec-mtp-graphs"))
    perm = make_drafting_checkpoint(path, "tiny-v3", TINY, ALPHA, torch.float32)
    backend = GraphNvidiaBackend(device=DEVICE)
    model = load_model(path, backend, torch.float32, progress=False, load_mtp=True)
    return path, backend, model, Tokenizer.from_pretrained(path), prompts(perm)


def api(buckets: list[int], kind: str = "stand-in"):
    """A decode runner as the graph API, with its buckets (nothing captured for decode itself): the stand-in, or on
    a GPU torch.cuda's graphs (backends/nvidia/graph_runner.py)."""
    cls = StandInGraphRunner
    if kind == "cuda":
        from deepinfer.backends.nvidia.graph_runner import CUDAGraphRunner as cls
    return cls(model=None, caches=None, block_size=BS, max_blocks_per_seq=8, buckets=buckets, group_names=["mla"])


class SpyModel:
    """Delegates to the model; records the (positions, seq_lens, KV slots) of every MTP forward it runs."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def mtp_forward(self, hidden, next_ids, batch, caches, k: int = 0):
        self.seen.append((batch.positions.tolist(), batch.seq_lens.tolist(), batch.slot_mapping["mla"].tolist()))
        return self.model.mtp_forward(hidden, next_ids, batch, caches, k)


def setup_drafters(backend, model, buckets: list[int], max_seqs: int, k: int, kind: str = "stand-in"):
    """((eager drafter, caches), (graph drafter, caches)) over two equal caches, and the tables on the device (the
    engine's mirror); every sequence row owns 8 blocks (row 2: none, -1)."""
    specs = model.kv_cache_specs(include_mtp=True)
    layouts = {s.name: backend.kv_cache_layout(s) for s in specs}
    tables = {s.name: torch.full((max_seqs, 8), -1, dtype=torch.int32) for s in specs}
    for r in range(max_seqs):
        if r != 2:
            tables["mla"][r] = torch.arange(8 * r, 8 * r + 8, dtype=torch.int32)
    mirror = {name: t.to(backend.device) for name, t in tables.items()}
    out = []
    for graphed in (False, True):
        caches = KVCaches.allocate(specs, {"mla": 8 * max_seqs}, BS, max_seqs, backend.device, layouts)
        graphs = None
        if graphed:
            spy = SpyModel(model) if kind == "stand-in" else model  # a CUDA capture allows no host reads
            graphs = MTPGraphRunner.capture(api(buckets, kind), spy, caches, mirror, {"mla": 1}, BS, max_seqs, k,
                                            backend.device)
        out.append((MTPDrafter(model, caches, tables, BS, specs, backend.device, graphs=graphs), caches))
    return out, mirror


def step_rows(model, rows: list[int], counts: list[int], ctx: int, seed: int, skip: int = 0):
    """(hidden states on the device, MTPRows): `counts` pass rows per sequence after `ctx` cached positions, drafting,
    their rows after `skip` leading rows the pass does not read."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(counts)
    hidden = torch.randn(total + skip, model.config.hidden_size, generator=gen).to(DEVICE)
    ids = torch.randint(0, 320, (total,), generator=gen).tolist()
    items, start = [], skip
    for r, n in zip(rows, counts):
        items.append(MTPRows(start, n, ids[start - skip:start - skip + n], ctx, True, r))
        start += n
    return hidden, items


def prefill(drafter: MTPDrafter, rows: list[int], ctx: int, seed: int, mirror) -> None:
    """The MTP KV of positions 0..ctx-1 of each row (an eager pass, no drafts), as earlier steps left it."""
    hidden, items = step_rows(drafter.model, rows, [ctx] * len(rows), 0, seed)
    items = [MTPRows(it.start, it.count, it.next_ids, 0, False, it.state_row) for it in items]
    saved, drafter.graphs = drafter.graphs, None
    drafter.run(hidden, items, [], mirror)
    drafter.graphs = saved


# (state rows, pass rows per sequence, chain lengths, buckets): padded passes and chains, a sequence without room
# for a chain (0) and one whose chain ends before the others' (its later links must write nothing)
CASES = {
    "b3-of-4-t6-of-8": ([1, 3, 0], [3, 1, 2], [3, 1, 2], [1, 2, 4, 8]),
    "b1-t1": ([3], [1], [2], [1, 2, 4, 8]),
    "b2-of-2-t5-of-8-one-without-room": ([0, 1], [2, 3], [3, 0], [1, 2, 8]),
}


GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")])


@pytest.mark.parametrize("kind", ["stand-in", GPU])
@pytest.mark.parametrize("case", list(CASES))
def test_graph_replayed_drafts_and_mtp_kv_equal_the_eager_drafter(parts, case, kind):
    """On a GPU (kind cuda) the graphs are real CUDA graphs: replays run the captured kernels, not the Python."""
    rows, counts, chains, buckets = CASES[case]
    _, backend, model, _, _ = parts
    k = 3
    ((eager, eager_caches), (graph, graph_caches)), mirror = setup_drafters(backend, model, buckets, 4, k, kind)
    ctx = 5  # cached positions 0..4; the pass writes 5.., the chain one position further per link
    for d in (eager, graph):
        prefill(d, rows, ctx, 1, mirror)
    hidden, items = step_rows(model, rows, counts, ctx, 2, skip=2)  # 2 leading rows the pass does not read
    total = sum(counts)
    want = eager.run(hidden, items, chains, mirror)
    spy = graph.graphs.model
    if kind == "stand-in":
        spy.seen.clear()
    got = graph.run(hidden, items, chains, mirror)
    assert graph.num_graph_passes == 1 and graph.num_graph_chains == (1 if max(chains) > 0 else 0)
    assert graph.num_eager_passes == 1 and graph.num_eager_chain_seqs == 0  # the prefill's pass only
    assert graph.graphs.num_link_replays == max(chains) - 1
    assert graph.graphs.num_chain_replays == (1 if max(chains) == k else 0)  # a full chain: head + links, one graph
    assert got.tokens == want.tokens and [len(t) for t in got.tokens] == chains
    tol = 1e-5 if kind == "stand-in" else 1e-3  # a GPU's fp32 Triton dots may round through TF32
    for a, b in zip(got.confidence, want.confidence):
        assert a == pytest.approx(b, abs=tol)
    assert any(len(set(t)) > 1 for t in got.tokens) or len(got.tokens) == 1  # drafts differ: not a constant
    for key, t in eager_caches.kv.items():  # the pass's rows and each live link's lookahead, nothing else
        torch.testing.assert_close(graph_caches.kv[key], t, atol=tol, rtol=tol)
    # what the replays ran: the pass as decode rows, padding rows reading and writing nothing; a link row past its
    # chain stays at its last pass position (its blocks are allocated) and writes nothing. (Seen by the stand-in
    # only: a CUDA graph replays kernels, not this Python.)
    if kind == "cuda":
        return
    (pos, lens, slots), links = spy.seen[0], spy.seen[1:]
    assert pos[:total] == [ctx + j for n in counts for j in range(n)] and all(x >= 0 for x in slots[:total])
    assert set(lens[total:]) <= {0} and set(slots[total:]) <= {-1} and lens[:total] == [p + 1 for p in pos[:total]]
    last = [ctx + n - 1 for n in counts]
    assert len(links) == max(chains) - 1
    for link, (pos, lens, slots) in enumerate(links, start=1):
        for i in range(len(pos)):
            if i < len(rows) and link < chains[i]:
                assert pos[i] == last[i] + link and lens[i] == pos[i] + 1 and slots[i] >= 0, (link, i)
            elif i < len(rows):
                assert pos[i] == last[i] and lens[i] == pos[i] + 1 and slots[i] == -1, (link, i)
            else:
                assert lens[i] == 0 and slots[i] == -1, (link, i)


def test_engine_drafting_from_graphs_equals_off(parts):
    """mtp k = 3 with decode graphs on: every drafting step's pass and chain replayed MTP graphs (none eager);
    greedy output == speculation off (eager)."""
    ps = parts[4]
    want, _ = run(make(parts, enforce_eager=True), ps, GREEDY)
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    drafter = on._spec.drafter
    assert drafter.graphs is not None and drafter.graphs.chain_buckets == [1, 2, 4]
    before = replays(on)
    got, _ = run(on, ps, GREEDY)
    assert got == want
    assert replays(on) > before
    assert drafter.num_graph_chains > 0 and drafter.num_eager_chain_seqs == 0
    assert drafter.num_graph_passes > 0
    assert drafter.num_eager_passes == 0  # the prompts' pass (21 rows, past the largest bucket, 16): two pieces
    assert on.stats().spec_accepted_tokens > 0


def test_adaptive_drafting_costs_are_timed_by_replays_that_leave_the_cache_alone(parts):
    """The confidence scheduler's drafting-cost table (spec/draft_cost.py) times the engine's drafter replaying its
    graphs (every point within the buckets), with every row staged as padding: after start-up the engine's KV
    cache is still all zeros (the step-cost profile writes nothing either)."""
    on = make(parts, speculative_method="mtp", num_speculative_tokens=2, speculative_adaptive=True,
              max_num_seqs=2, max_num_batched_tokens=6)
    table, graphs = on._spec.policy.draft_cost, on._spec.drafter.graphs
    assert table.counts == [1, 2] and table.shapes == ["graph", "graph"]
    assert graphs.num_pass_replays == graphs.num_head_replays == 2 * 2 * 2  # (chain 1, chain k) x counts x repeats
    assert graphs.num_link_replays == 2 * 2 * (2 - 1)
    assert all(not t.any() for t in on.runner.caches.kv.values())


class BanMask:
    """A grammar-mask stand-in (DraftGrammarMask's interface): drafting sequence `j` may draft only ids >= 160;
    records the drafts it was shown at each call (the host view a real mask fills its bitmask from)."""

    def __init__(self, j: int):
        self.j, self.calls = j, []

    def constrains(self, j: int) -> bool:
        return j == self.j

    def __call__(self, live, tokens, logits):
        self.calls.append([list(tokens[j]) for j in live])
        if self.j in live:
            logits = logits.clone()
            logits[live.index(self.j), :160] = float("-inf")
        return logits


def test_a_masked_sequences_chain_runs_eagerly_and_the_others_replay(parts):
    """A structured sequence's links need its drafts so far on the host (its grammar state): its chain runs
    eagerly under the mask, the others' replay; drafts == the eager drafter's under the same mask."""
    _, backend, model, _, _ = parts
    rows, counts, chains, buckets = CASES["b3-of-4-t6-of-8"]
    ((eager, _), (graph, _)), mirror = setup_drafters(backend, model, buckets, 4, 3)
    for d in (eager, graph):
        prefill(d, rows, 5, 1, mirror)
    hidden, items = step_rows(model, rows, counts, 5, 3)
    want = eager.run(hidden, items, chains, mirror, BanMask(0))
    mask = BanMask(0)
    got = graph.run(hidden, items, chains, mirror, mask)
    assert got.tokens == want.tokens and all(t >= 160 for t in got.tokens[0])
    for a, b in zip(got.confidence, want.confidence):
        assert a == pytest.approx(b, abs=1e-5)
    assert graph.num_graph_chains == 1 and graph.num_eager_chain_seqs == 1 and graph.graphs.num_link_replays == 1
    assert mask.calls == [[[]], [got.tokens[0][:1]], [got.tokens[0][:2]]]  # the masked chain alone, link by link


@pytest.mark.parametrize("kind", ["stand-in", GPU])
def test_a_pass_past_the_largest_bucket_replays_in_pieces_and_equals_the_eager_pass(parts, kind):
    """9 pass rows over buckets up to 4 (an MTP-KV catch-up after a long pause holds more rows than the verify
    graphs): three replays of 4, 4 and 1 rows in row order, a sequence's rows split across pieces (row 3's four
    rows: one in the first piece, three in the second); drafts, confidences and the MTP KV equal one eager pass's,
    and no pass runs eagerly (an eager forward at a new row count compiles kernels on a GPU)."""
    _, backend, model, _, _ = parts
    rows, counts, chains, k = [1, 3, 0], [3, 4, 2], [3, 2, 3], 3
    ((eager, eager_caches), (graph, graph_caches)), mirror = setup_drafters(backend, model, [1, 2, 4], 4, k, kind)
    ctx = 5
    for d in (eager, graph):
        prefill(d, rows, ctx, 3, mirror)
    hidden, items = step_rows(model, rows, counts, ctx, 4, skip=1)
    want = eager.run(hidden, items, chains, mirror)
    got = graph.run(hidden, items, chains, mirror)
    assert graph.graphs.num_pass_replays == 3 and graph.num_graph_passes == 3
    assert graph.num_eager_passes == 1 and graph.num_eager_chain_seqs == 0  # the prefill's pass only
    assert got.tokens == want.tokens and [len(t) for t in got.tokens] == chains
    tol = 1e-5 if kind == "stand-in" else 1e-3
    for a, b in zip(got.confidence, want.confidence):
        assert a == pytest.approx(b, abs=tol)
    for key, t in eager_caches.kv.items():
        torch.testing.assert_close(graph_caches.kv[key], t, atol=tol, rtol=tol)
    # past max_pieces replays (a prompt-sized pass) the pass runs eagerly, in the prefill's shape
    graph.max_pieces = 2
    graph.run(hidden, items, chains, mirror)
    assert graph.num_eager_passes == 2 and graph.graphs.num_pass_replays == 3
