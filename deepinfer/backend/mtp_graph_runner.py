"""MTP drafting graphs: the speculative drafter's MTP pass and chain links replayed from captured graphs.

Why. A drafting step runs the MTP module (one decoder layer, a norm and the output head) once over the step's
verified rows (the pass) and once per further chain link. Eagerly that is hundreds of kernel launches per
forward, each paid in host time; on the H200 (2026-12-03) the eager drafter was ~8 ms of host per step for
~0.6 ms of device work at concurrency 1. The decode graphs remove the same cost from decode and verify steps
(graph_runner.py); this runner does it for the drafter, over the same graph API.

The graph API is the backend's: the runner is built over the engine's `DecodeGraphRunner` (its `new_pool`,
`capture_one`, `replay`, `finish_capture`: CUDA graphs on NVIDIA, a stand-in in the tests), so a backend that
captures decode graphs captures these too, with no code of its own.

Three kinds of graphs, all over static inputs (one int64 buffer filled by ONE host-to-device copy per drafting
step, `stage`; its padded rows are inert, see below):
- pass[T], per row bucket T: the MTP forward over T decode rows (one row per verified token: row j of a sequence
  is a one-token query at its position, whose KV the same launch writes before any row attends, so it is causal
  by construction, as spec/verify_batch.py's verify rows). Inputs: the hidden states (gathered into a static
  buffer by one index_select), the token after each row, its position and its sequence's row in the KV tables.
  Output: the normed MTP states, in a static buffer.
- head[B], per drafting-sequence bucket B: draft 1 of each drafting sequence, the argmax of the MTP head at its
  last pass row (gathered into the chain state by one index_select), and its probability (the confidence).
- link[B]: one chain link: the MTP forward of the chain state and the previous draft at the next position,
  then the head; it advances the chain in place (state, draft, a device-side link counter), so the k - 1 links
  of a step are k - 1 replays of one graph with no host work between them. Drafts and confidences land in
  [B, k] static buffers, read back once per step by the caller.
- chain[B] (k > 1): the head and the k - 1 links captured into ONE graph, so a full chain (what static k drafts
  every step) is one replay instead of k; the link's device-side counter makes the k - 1 captured link launches
  advance one position each, as k - 1 replays of link[B] do. Shorter chains (the confidence scheduler's) replay
  head[B] and link[B] as before.
Block tables and KV slots are computed inside the graphs from the engine's device mirror of the KV manager's
tables (the batch builder's `mirror`, whose tensors never move) and the staged positions, so nothing per token is
built on the host: by the backend's `decode_rows_meta` op (one kernel on NVIDIA, since 2026-12-05; ~20 small torch
ops a forward before, most of a speculative step's small kernels), into static buffers (`RowsMeta`); each head's
draft and confidence by its `draft_pick` op (one kernel on NVIDIA). A row is padding when its sequence row is -1:
sequence length 0 (reads nothing), KV slot -1 (writes nothing). A chain row past its chain length (`c_len`) stays
at its last pass position, writes nothing and its outputs are ignored; so one replay serves sequences with
different chain lengths, and a sequence without room for a chain (chain length 0) writes no lookahead KV.

Not graphed (the caller runs them eagerly): a pass of more rows than the largest bucket (a prompt chunk, a long
catch-up), and chain links under a grammar mask (host work between links: the mask depends on the drafts so far).
Models with per-sequence state (V4) get no runner (a padded row would write into a real row), as for decode.

Memory: one pool shared by these graphs (the largest pass bucket's activations of one decoder layer, and the head's
[B, vocab] fp32 logits and probabilities at the largest chain bucket; a chain graph's k links reuse the pool, their
intermediates are freed within the capture as in eager mode), plus static buffers: hidden states and states of
T_max + 2 * B_max rows and 7 * T_max + 8 * B_max int64.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.backend.forward_batch import ForwardBatch
from deepinfer.backend.native.decode_rows import decode_rows_meta as native_decode_rows_meta
from deepinfer.backend.native.draft_pick import draft_pick as native_draft_pick

if TYPE_CHECKING:
    from deepinfer.backend.graph_runner import DecodeGraphRunner

log = logging.getLogger(__name__)

# the staged int64 segments, in buffer order: pass rows (T_max each), then chain rows (B_max each)
PASS_FIELDS = ("p_src", "p_ids", "p_pos", "p_row")
CHAIN_FIELDS = ("c_src", "c_row", "c_pos", "c_len")
# optional segments the graphs never read: the one-sync speculative step (spec/one_sync.py) stages with them what
# it needs to derive the pass and chain inputs on the device from the verification (a pass row's sequence, index in
# it and draft token; a drafting sequence's first verify row, drafts verified, context length, KV room), in the
# same copy
PASS_EXTRA = ("f_seq", "f_j", "f_tok")
CHAIN_EXTRA = ("f_start", "f_dlen", "f_ctx", "f_room")
# what a padded row of each segment holds: inert (row -1: no read, no write; chain length 0)
PAD = {"p_src": 0, "p_ids": 0, "p_pos": 0, "p_row": -1, "c_src": 0, "c_row": -1, "c_pos": 0, "c_len": 0,
       "f_seq": 0, "f_j": 0, "f_tok": 0, "f_start": 0, "f_dlen": 0, "f_ctx": 0, "f_room": 0}


def mtp_draft_logits(model, state: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, vocab] of the MTP head at the normed states [N, D] (a grammar mask applies to these)."""
    return model.mtp_logits(state)[:, : model.vocab_size].float()


def argmax_confidence(logits: torch.Tensor, pick_op: Callable = native_draft_pick) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """(argmax ids [N], their probabilities [N]): a draft and its confidence, by `pick_op` (Backend.draft_pick,
    the op the graphs run: so the eager drafter's drafts are the replayed ones; default the native op)."""
    n = logits.shape[0]
    ids = torch.empty(n, dtype=torch.int64, device=logits.device)
    conf = torch.empty(n, dtype=torch.float32, device=logits.device)
    pick_op(logits, logits.shape[1], ids, conf)
    return ids, conf


@dataclass
class MTPStatic:
    """The static inputs and outputs the MTP graphs read and write (sized for the largest buckets)."""

    t_max: int
    b_max: int
    k: int
    ints: torch.Tensor  # [7 * t_max + 8 * b_max] int64, on the device: the staged segments
    host: torch.Tensor  # the same layout on the host (pinned on accelerators): one copy per step
    # a second host buffer of that layout: steps alternate between the two (`flip_host`), so staging step N + 1
    # never waits for step N's copy, which a chained step queues behind N's forward (spec/chained_steps.py)
    host_spare: torch.Tensor
    p_hidden: torch.Tensor  # [t_max, D] the pass's input hidden states
    p_out: torch.Tensor  # [t_max, D] the pass's output states
    c_state: torch.Tensor  # [b_max, D] the chain's current state
    c_ids: torch.Tensor  # [b_max] int64 the chain's current draft
    c_conf: torch.Tensor  # [b_max] fp32 its confidence
    link: torch.Tensor  # [1] int64: the next link's index (reset by the head graph)
    out_ids: torch.Tensor  # [b_max, k] int64 drafts
    out_conf: torch.Tensor  # [b_max, k] fp32 confidences
    zeros: torch.Tensor  # [t_max] int64 (the batch's input ids: the MTP forward takes its tokens apart)
    qsl: torch.Tensor  # [t_max + 1] int32 0..t_max
    no_logits: torch.Tensor  # [0] int64
    offsets: dict[str, int] = field(default_factory=dict)
    host_np: object = None  # a numpy view of `host`
    # each segment's view of `ints` / `host`, made once (a step reads a dozen of them: a slice each time cost ~1 us
    # of host time apiece)
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    host_views: dict[str, torch.Tensor] = field(default_factory=dict)
    _layouts: dict[tuple[str, ...], tuple] = field(default_factory=dict)  # write_host's, per names
    _spare: tuple = ()  # (host_spare, its numpy view, its segment views), made once
    host_index: int = 0  # which of the two buffers `host` is (0: the first allocated)

    def __post_init__(self) -> None:
        for name, o in self.offsets.items():
            self.views[name] = self.ints[o : o + self.size(name)]
        self.host_np, self.host_views = self._host_set(self.host)
        self._spare = (self.host_spare, *self._host_set(self.host_spare))

    def _host_set(self, host: torch.Tensor) -> tuple[object, dict[str, torch.Tensor]]:
        return host.numpy(), {name: host[o : o + self.size(name)] for name, o in self.offsets.items()}

    def flip_host(self) -> int:
        """Make the other host buffer the one staged into; returns the index (0 / 1) of the buffer now in use, for
        the caller's per-buffer copy events."""
        current = (self.host, self.host_np, self.host_views)
        self.host, self.host_np, self.host_views = self._spare
        self._spare = current
        self.host_spare = current[0]
        self.host_index ^= 1
        return self.host_index

    @classmethod
    def allocate(cls, t_max: int, b_max: int, k: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> MTPStatic:
        offsets, o = {}, 0
        for name in PASS_FIELDS + PASS_EXTRA:
            offsets[name], o = o, o + t_max
        for name in CHAIN_FIELDS + CHAIN_EXTRA:
            offsets[name], o = o, o + b_max
        pinned = device.type != "cpu"
        host = torch.empty(o, dtype=torch.int64, pin_memory=pinned)
        spare = torch.empty(o, dtype=torch.int64, pin_memory=pinned)  # (on the CPU too: the tests run the flips)
        st = cls(t_max=t_max, b_max=b_max, k=k, ints=torch.empty(o, dtype=torch.int64, device=device), host=host,
                 host_spare=spare,
                 p_hidden=torch.zeros((t_max, hidden), dtype=dtype, device=device),
                 p_out=torch.zeros((t_max, hidden), dtype=dtype, device=device),
                 c_state=torch.zeros((b_max, hidden), dtype=dtype, device=device),
                 c_ids=torch.zeros(b_max, dtype=torch.int64, device=device),
                 c_conf=torch.zeros(b_max, dtype=torch.float32, device=device),
                 link=torch.ones(1, dtype=torch.int64, device=device),
                 out_ids=torch.zeros((b_max, k), dtype=torch.int64, device=device),
                 out_conf=torch.zeros((b_max, k), dtype=torch.float32, device=device),
                 zeros=torch.zeros(t_max, dtype=torch.int64, device=device),
                 qsl=torch.arange(t_max + 1, dtype=torch.int32, device=device),
                 no_logits=torch.empty(0, dtype=torch.int64, device=device), offsets=offsets)
        for name, value in PAD.items():  # every row inert until staged (warm-ups and captures read these)
            st.seg_host(name).fill_(value)
        spare.copy_(host)
        st.ints.copy_(st.host)
        return st

    def size(self, name: str) -> int:
        return self.t_max if name in PASS_FIELDS or name in PASS_EXTRA else self.b_max

    def seg(self, name: str) -> torch.Tensor:
        return self.views[name]

    def seg_host(self, name: str) -> torch.Tensor:
        return self.host_views[name]

    def write_host(self, names: tuple[str, ...], data: list[list[int]], bucket: int) -> None:
        """Host segments `names` <- data (one list each), each padded with its inert value up to `bucket` rows.
        Numpy over the (pinned) host buffer, no tensor per segment; segments that lie back to back in the buffer
        and hold as many rows each are written as one [len(names), size] block (one conversion and one padding
        write for all of them, where a write per segment cost ~1-2 us each)."""
        lens = set(map(len, data))
        if max(lens) > bucket:
            name, values = next((m, v) for m, v in zip(names, data) if len(v) > bucket)
            raise ValueError(f"MTPGraphRunner.stage: {len(values)} {name} rows for a bucket of {bucket}")
        layout = self._layouts.get(names)
        if layout is None:  # (first offset, rows per segment, back to back?, padding column): once per names
            size, o = self.size(names[0]), self.offsets[names[0]]
            layout = self._layouts[names] = (
                o, size, all(self.offsets[m] == o + i * size for i, m in enumerate(names)),
                np.array([[PAD[m]] for m in names], dtype=np.int64))
        o, size, back_to_back, pads = layout
        if back_to_back and len(lens) == 1:
            n = lens.pop()
            block = self.host_np[o : o + len(names) * size].reshape(len(names), size)
            block[:, :n] = data
            block[:, n:bucket] = pads
            return
        for name, values in zip(names, data):
            o = self.offsets[name]
            self.host_np[o : o + len(values)] = values
            self.host_np[o + len(values) : o + bucket] = PAD[name]

    def seg_pair(self, first: str, second: str) -> torch.Tensor:
        """[2, size] view of two segments of the same size (rows: first, second), so one op can write or read both
        (the one-sync step derives c_src and c_pos from f_start and f_ctx with one add)."""
        size = self.size(first)
        if self.size(second) != size:
            raise ValueError(f"MTPStatic.seg_pair: {first} and {second} differ in size")
        a, b = self.offsets[first], self.offsets[second]
        if b <= a:
            raise ValueError(f"MTPStatic.seg_pair: {second} must come after {first} in the buffer")
        return self.ints.as_strided((2, size), (b - a, 1), self.ints.storage_offset() + a)


@dataclass
class RowsMeta:
    """Where `decode_rows_meta` writes the graphs' decode rows' inputs (T_max rows: the pass's, and at most B_max
    of a chain link's, which never run at the same time: a forward reads them before the next op rewrites them)."""

    tables: dict[str, torch.Tensor]  # group -> [T_max, W] int32
    slots: dict[str, torch.Tensor]  # group -> [T_max] int64
    seq_lens: torch.Tensor  # [T_max] int32
    context_lens: torch.Tensor  # [T_max] int32
    positions: torch.Tensor  # [T_max] int64 (a chain link's)

    @classmethod
    def allocate(cls, rows: int, tables: dict[str, torch.Tensor], device: torch.device) -> RowsMeta:
        return cls(tables={g: torch.zeros((rows, t.shape[1]), dtype=torch.int32, device=device)
                           for g, t in tables.items()},
                   slots={g: torch.full((rows,), -1, dtype=torch.int64, device=device) for g in tables},
                   seq_lens=torch.zeros(rows, dtype=torch.int32, device=device),
                   context_lens=torch.zeros(rows, dtype=torch.int32, device=device),
                   positions=torch.zeros(rows, dtype=torch.int64, device=device))


@dataclass
class MTPGraphRunner:
    """Captured MTP pass / head / link graphs over static inputs; `api` supplies the graph API (module docstring).

    model: has mtp_forward(hidden, next_ids, batch, caches), mtp_logits, vocab_size; tables: the device mirror of
    the KV manager's block tables (group -> [rows, width] int32, updated in place); tokens_per_entry: per group."""

    api: DecodeGraphRunner
    model: object
    caches: object
    tables: dict[str, torch.Tensor]
    tokens_per_entry: dict[str, int]
    block_size: int
    pass_buckets: list[int]
    chain_buckets: list[int]
    k: int
    meta_op: Callable = native_decode_rows_meta  # Backend.decode_rows_meta (its signature)
    pick_op: Callable = native_draft_pick  # Backend.draft_pick (its signature)
    static: MTPStatic | None = None
    meta: RowsMeta | None = None
    pass_graphs: dict[int, object] = field(default_factory=dict)
    head_graphs: dict[int, object] = field(default_factory=dict)
    link_graphs: dict[int, object] = field(default_factory=dict)
    chain_graphs: dict[int, object] = field(default_factory=dict)  # head + k - 1 links in one graph (k > 1)
    # per host buffer (MTPStatic.flip_host): recorded after its last staging copy (the buffer is rewritten after it)
    _events: list = field(default_factory=lambda: [None, None])
    num_pass_replays: int = 0
    num_head_replays: int = 0
    num_link_replays: int = 0
    num_chain_replays: int = 0  # full chains replayed as one graph (each also counts one head and k - 1 links)

    @classmethod
    def capture(cls, api: DecodeGraphRunner, model, caches, tables: dict[str, torch.Tensor],
                tokens_per_entry: dict[str, int], block_size: int, max_seqs: int, k: int,
                device: torch.device, meta_op: Callable | None = None,
                pick_op: Callable | None = None) -> MTPGraphRunner | None:
        """Graphs for passes of up to the decode graphs' largest bucket of rows (the verify rows a step can
        hold: every sequence's real token and k drafts) and chains of up to max_seqs sequences (the decode
        graphs' buckets up to it, and max_seqs). None when the decode runner captured nothing (per-sequence
        state: no padding-safe row). meta_op / pick_op: the backend's decode_rows_meta / draft_pick (None: the
        native ops)."""
        if api.uses_state or not api.buckets or k < 1:
            return None
        pass_buckets = sorted(api.buckets)
        chain_buckets = sorted({b for b in pass_buckets if b < max_seqs} | {min(max_seqs, pass_buckets[-1])})
        runner = cls(api=api, model=model, caches=caches, tables=dict(tables), tokens_per_entry=dict(tokens_per_entry),
                     block_size=block_size, pass_buckets=pass_buckets, chain_buckets=chain_buckets, k=k,
                     meta_op=meta_op or native_decode_rows_meta, pick_op=pick_op or native_draft_pick)
        runner.static = MTPStatic.allocate(pass_buckets[-1], chain_buckets[-1], k, model.config.hidden_size,
                                           model.dtype, device)
        runner.meta = RowsMeta.allocate(max(pass_buckets[-1], chain_buckets[-1]), runner.tables, device)
        runner._capture_all()
        return runner

    # ------------------------------------------------------------ the captured functions

    def _rows_batch(self, rows: torch.Tensor, positions: torch.Tensor, link: torch.Tensor | None = None,
                    lens: torch.Tensor | None = None) -> ForwardBatch:
        """One-token decode rows over the mirrored tables: rows -1 are padding (length 0, no KV write); with a
        chain link's index `link` and the rows' chain lengths `lens`, a row past its chain stays at `positions`
        and writes nothing, the others sit at positions + link (backend/native/decode_rows.py). One
        `decode_rows_meta` per KV group into the static `meta` buffers. Device ops only: capturable."""
        n = int(rows.shape[0])
        m = self.meta
        for i, (g, t) in enumerate(self.tables.items()):
            first = i == 0  # lengths and positions are the same for every group: written with the first
            self.meta_op(t, rows, positions, self.tokens_per_entry[g], self.block_size, m.tables[g], m.slots[g],
                         m.seq_lens if first else None, m.context_lens if first else None,
                         m.positions if first and link is not None else None, link, lens)
        st = self.static
        return ForwardBatch(
            input_ids=st.zeros[:n], positions=m.positions[:n] if link is not None else positions,
            query_start_loc=st.qsl[: n + 1], seq_lens=m.seq_lens[:n], context_lens=m.context_lens[:n],
            block_tables={g: t[:n] for g, t in m.tables.items()}, slot_mapping={g: t[:n] for g, t in m.slots.items()},
            logits_indices=st.no_logits, query_lens_cpu=[1] * n, seq_lens_cpu=[1] * n, context_lens_cpu=[0] * n,
            state_slots=None, state_slots_cpu=[], block_size=self.block_size)

    def _pass(self, t: int) -> torch.Tensor:
        st = self.static
        batch = self._rows_batch(st.seg("p_row")[:t], st.seg("p_pos")[:t])
        state = self.model.mtp_forward(st.p_hidden[:t], st.seg("p_ids")[:t], batch, self.caches)
        st.p_out[:t].copy_(state)
        return st.p_out[:t]

    def _head(self, b: int) -> torch.Tensor:
        st = self.static
        # draft 1: into the chain's next input (c_ids), the drafts' column 0 and its confidence
        self.pick_op(self.model.mtp_logits(st.c_state[:b]), self.model.vocab_size, st.c_ids, st.c_conf, st.out_ids,
                     st.out_conf)
        st.link.fill_(1)
        return st.out_ids[:b]

    def _link(self, b: int) -> torch.Tensor:
        st = self.static
        # a row whose chain is shorter than this link recomputes its last pass position and writes nothing
        batch = self._rows_batch(st.seg("c_row")[:b], st.seg("c_pos")[:b], st.link, st.seg("c_len")[:b])
        state = self.model.mtp_forward(st.c_state[:b], st.c_ids[:b], batch, self.caches)
        st.c_state[:b].copy_(state)
        # the draft at this link's column (clamped to k - 1: warm-ups run it more often than k - 1 times)
        self.pick_op(self.model.mtp_logits(state), self.model.vocab_size, st.c_ids, st.c_conf, st.out_ids,
                     st.out_conf, st.link)
        st.link.add_(1)
        return st.out_ids[:b]

    def _chain(self, b: int) -> torch.Tensor:
        """The head and k - 1 links, as their own graphs would run them one replay after another."""
        self._head(b)
        for _ in range(self.k - 1):
            self._link(b)
        return self.static.out_ids[:b]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = self.api.new_pool()
        for t in sorted(self.pass_buckets, reverse=True):  # largest first: the pool is sized once
            self.pass_graphs[t], _ = self.api.capture_one(lambda t=t: self._pass(t), pool)
        for b in sorted(self.chain_buckets, reverse=True):
            self.head_graphs[b], _ = self.api.capture_one(lambda b=b: self._head(b), pool)
            self.link_graphs[b], _ = self.api.capture_one(lambda b=b: self._link(b), pool)
            if self.k > 1:
                self.chain_graphs[b], _ = self.api.capture_one(lambda b=b: self._chain(b), pool)
        self.api.finish_capture()
        self.static.link.fill_(1)
        log.info("captured MTP graphs: pass for %s rows, head, link and full chain for %s drafting sequences",
                 self.pass_buckets, self.chain_buckets)

    # ------------------------------------------------------------ replay

    @staticmethod
    def _bucket(buckets: list[int], n: int) -> int | None:
        """The smallest bucket >= n (buckets sorted ascending, as `build` makes them), None past the largest: by
        bisection (every one-sync step asks twice, ~1 us each by a generator on this CPU)."""
        i = bisect.bisect_left(buckets, n)
        return buckets[i] if i < len(buckets) else None

    def pass_bucket(self, rows: int) -> int | None:
        return self._bucket(self.pass_buckets, rows)

    def chain_bucket(self, seqs: int) -> int | None:
        return self._bucket(self.chain_buckets, seqs)

    def stage(self, values: dict[str, list[int]], pass_bucket: int | None, chain_bucket: int | None) -> None:
        """Write the step's rows (segment name -> values; PASS_FIELDS when the pass replays, CHAIN_FIELDS when the
        chain does, and any of PASS_EXTRA / CHAIN_EXTRA given) and pad each segment up to its bucket with inert rows;
        then one copy to the device."""
        groups = []
        for names, extra, bucket in ((PASS_FIELDS, PASS_EXTRA, pass_bucket), (CHAIN_FIELDS, CHAIN_EXTRA, chain_bucket)):
            if bucket is not None:
                names = names + tuple(n for n in extra if n in values)
                groups.append((names, [values[n] for n in names], bucket))
        self._stage(groups)

    def stage_all(self, pass_rows: list[list[int]], chain_rows: list[list[int]], pass_bucket: int,
                  chain_bucket: int) -> None:
        """`stage` of every segment, the lists in buffer order (PASS_FIELDS + PASS_EXTRA, CHAIN_FIELDS +
        CHAIN_EXTRA): what the one-sync step stages, without a dict of names to build and look up."""
        self._stage([(PASS_FIELDS + PASS_EXTRA, pass_rows, pass_bucket),
                     (CHAIN_FIELDS + CHAIN_EXTRA, chain_rows, chain_bucket)])

    def _stage(self, groups: list[tuple[tuple[str, ...], list[list[int]], int]]) -> None:
        """Write each (names, their lists, bucket) into a host buffer, then one copy to the device. The two host
        buffers alternate: the one written was last copied two steps ago, so waiting for that copy is waiting for
        step N - 1's, long done even when this step is chained behind step N's forward on the device."""
        st = self.static
        i = st.flip_host()
        if self._events[i] is not None:
            self._events[i].synchronize()
        for names, data, bucket in groups:
            st.write_host(names, data, bucket)
        st.ints.copy_(st.host, non_blocking=True)
        if st.ints.device.type != "cpu":
            event = torch.Event(device=st.ints.device)
            event.record()
            self._events[i] = event

    def run_pass(self, hidden: torch.Tensor, rows: int, bucket: int) -> torch.Tensor:
        """The staged pass over `rows` rows of `hidden` (gathered by p_src): the MTP states [rows, D]."""
        st = self.static
        torch.index_select(hidden, 0, st.seg("p_src")[:bucket], out=st.p_hidden[:bucket])
        self.api.replay(self.pass_graphs[bucket])
        self.num_pass_replays += 1
        return st.p_out[:rows]

    def run_chain(self, states: torch.Tensor, seqs: int, bucket: int, links: int) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
        """The staged chain: draft 1 from the rows c_src of `states`, then links - 1 further links (links = k: the
        chain graph, one replay). Returns the device buffers (ids [seqs, k] int64, confidences [seqs, k] fp32);
        columns >= a row's chain length hold nothing of it."""
        st = self.static
        torch.index_select(states, 0, st.seg("c_src")[:bucket], out=st.c_state[:bucket])
        if links == self.k and bucket in self.chain_graphs:
            self.api.replay(self.chain_graphs[bucket])
            self.num_chain_replays += 1
            self.num_head_replays += 1
            self.num_link_replays += links - 1
            return st.out_ids[:seqs], st.out_conf[:seqs]
        self.api.replay(self.head_graphs[bucket])
        self.num_head_replays += 1
        for _ in range(links - 1):
            self.api.replay(self.link_graphs[bucket])
            self.num_link_replays += 1
        return st.out_ids[:seqs], st.out_conf[:seqs]
