"""MTP drafting: the checkpoint's MTP module runs after each step's verification, over the positions
whose next token is now known, and then chains on its own output to draft up to k tokens.

The MTP module at position i reads the main model's final hidden state h_i and the token t_{i+1}, and
attends over its own KV cache of earlier positions (layer id num_hidden_layers, in the MLA group: the
same blocks and slots as the main layers; models/deepseek_v3/mtp.py). So after a step:

1. the pass: for every scheduled sequence, the MTP module runs over the step's rows whose next token is
   known on the host (a prompt chunk: all its rows; a verified decode: its real token and the accepted
   drafts), writing the MTP KV of those positions, exactly as training evaluated it
   (tools/stdlib_coder/evaluate_heldout.py: `mtp_hidden(h[:, :-1], ids[:, 1:])`);
2. draft 1 of a sequence that sampled is the argmax of the MTP logits at its last such row (the token two
   ahead of the last verified one: one ahead of the token just emitted);
3. the chain (k > 1, the one module reused as vLLM does): the MTP module's own normed output state takes
   the place of h, the previous draft the place of the next token, one position further; each link writes
   MTP KV one position ahead (the "lookahead"), which the caller has allocated and which the next step's
   pass rewrites before anything reads it (the MTP attention is causal).

Confidence of a draft: the MTP distribution's probability of its own (argmax) token; a function of the
context only, so the confidence scheduler stays non-anticipating (spec/scheduler.py).

Where graphs are captured (backend/mtp_graph_runner.py), the pass runs as one decode row per token (row j of a
sequence attends over positions <= its own, whose KV the same launch writes first: causal by construction, as
verify rows in spec/verify_batch.py) and replays a bucket's graph; the chain replays a head graph and k - 1 link
graphs. The host stages every integer input in one copy and reads the drafts back once per step. Eager (on the cpu
backend, a pass past the largest bucket, and structured sequences' chains) the pass is one varlen batch and the
chain reads its drafts back once at the end (every link when a grammar mask needs them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend import ForwardBatch, KVCaches, MTPGraphRunner, argmax_confidence, mtp_draft_logits, token_slots
from deepinfer.backend.native.draft_pick import draft_pick as native_draft_pick
from deepinfer.worker.transfer import tensor_to, to_device


@dataclass
class MTPRows:
    """One sequence's rows in the MTP pass: rows [start, start + count) of the step's hidden states, the
    token after each, and whether it drafts (it sampled this step and goes on)."""

    start: int
    count: int
    next_ids: list[int]
    context_len: int
    drafts: bool
    state_row: int  # its row in the KV manager's tables


@dataclass
class Drafts:
    """Per drafting sequence (pass order): the drafted ids and their confidences."""

    tokens: list[list[int]]
    confidence: list[list[float]]


class MTPDrafter:
    """Drafts with MTP module 0 of `model` (model.mtp_forward / model.mtp_logits).

    graphs: the backend's captured MTP graphs (backend/mtp_graph_runner.py), or None (eager). With graphs, a pass
    replays as decode rows (one graph of its bucket, or a pass past the largest bucket as up to max_pieces, in
    order) and the chain of the drafting sequences replays link by link; drafts and confidences are read back once
    per step. Eagerly (no graphs, a pass of more rows than that, or the chains of sequences drafting under a grammar
    mask, whose mask needs the drafts so far on the host at every link) the same math runs as before, the pass as
    one varlen batch."""

    def __init__(self, model, caches: KVCaches, block_tables: dict[str, torch.Tensor], block_size: int,
                 specs, device: torch.device, graphs: MTPGraphRunner | None = None, pick_op=None, snapshot_kv=None):
        """pick_op: the backend's draft_pick (None: the graphs', else the native op), so eager and replayed
        chains pick drafts alike. snapshot_kv: the KV manager of a model with per-sequence state (V4): with prefix
        caching (its `snapshots`), the pass saves the MTP layers' rings at the block boundaries its rows cross, as
        the step's forward saved the main layers' (kv/state_snapshots.py, `snapshot_plan_rows`)."""
        self.model = model
        self.snapshot_kv = snapshot_kv
        self.pick_op = pick_op or (graphs.pick_op if graphs is not None else native_draft_pick)
        self.caches = caches
        self.tables = block_tables  # the KV manager's host tables (token slots are read from them)
        self.block_size = block_size
        self.specs = list(specs)
        # models whose groups keep per-sequence state (V4's compressor rings): a batch names each request's state
        # row, which is its row in the block tables (KVCacheManager.state_slot)
        self.state_rows = any(s.state_shape for s in self.specs)
        self.device = device
        self.graphs = graphs
        self.num_graph_passes = 0  # passes replayed / run eagerly
        self.num_eager_passes = 0
        self.num_graph_chains = 0  # steps whose chains replayed (all their drafting sequences but masked ones)
        self.num_eager_chain_seqs = 0  # drafting sequences whose chain ran eagerly (no graphs, or a grammar mask)
        self.num_host_reads = 0  # waits for the device: the drafts read back (once per chain, or per masked link)
        # a pass past the largest pass graph replays it in at most this many pieces (`_pass_in_pieces`); a larger
        # one (a prompt-sized pass) runs eagerly, in the prefill's shape, whose kernels the model's own prefill at
        # that row count has compiled
        self.max_pieces = 4

    def replays(self, rows: int, seqs: int) -> bool:
        """Whether a drafting step of `rows` pass rows and `seqs` drafting sequences replays graphs throughout."""
        g = self.graphs
        return g is not None and g.pass_bucket(rows) is not None and (seqs == 0 or g.chain_bucket(seqs) is not None)

    def _batch(self, rows: list[int], positions: list[int], query_lens: list[int], context_lens: list[int],
               device_tables: dict[str, torch.Tensor]) -> ForwardBatch:
        """A ForwardBatch over `rows` of the KV tables: query_lens tokens each after context_lens, at `positions`.
        Its integer inputs go up in one host-to-device copy."""
        n, t = len(rows), len(positions)
        req_idx = [i for i, q in enumerate(query_lens) for _ in range(q)]
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        host = torch.tensor(positions + qsl + seq_lens + list(context_lens) + list(rows), dtype=torch.int64)
        state_slots, state_rows_cpu = None, []
        pos_host, token_rows = host[:t], torch.tensor([rows[i] for i in req_idx], dtype=torch.int64)
        slots = [token_slots(self.tables[s.name], token_rows, pos_host, s.tokens_per_entry, self.block_size)
                 for s in self.specs]
        dev = to_device(torch.cat([host, *slots]), self.device)
        o = t + (n + 1) + 2 * n
        rows_dev = dev[o : o + n]
        block_tables, slot_mapping = {}, {}
        for j, spec in enumerate(self.specs):
            width = max(-(-(max(seq_lens) // spec.tokens_per_entry) // self.block_size), 1)
            block_tables[spec.name] = device_tables[spec.name][:, :width].index_select(0, rows_dev)
            slot_mapping[spec.name] = dev[o + n + j * t : o + n + (j + 1) * t]
        if self.state_rows:
            state_rows_cpu = list(rows)
            state_slots = rows_dev.to(torch.int32)
        return ForwardBatch(
            input_ids=torch.zeros(t, dtype=torch.int64, device=self.device),
            positions=dev[:t],
            query_start_loc=dev[t : t + n + 1].to(torch.int32),
            seq_lens=dev[t + n + 1 : t + 2 * n + 1].to(torch.int32),
            context_lens=dev[t + 2 * n + 1 : o].to(torch.int32),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=torch.empty(0, dtype=torch.int64, device=self.device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=seq_lens,
            context_lens_cpu=list(context_lens),
            state_slots=state_slots,
            state_slots_cpu=state_rows_cpu,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, items: list[MTPRows], chain_lens: list[int],
            device_tables: dict[str, torch.Tensor], mask=None, probe: bool = False) -> Drafts:
        """The pass over `items` (hidden [T, D] of the step) and the chain: drafting item j (in order) gets
        1 + (chain_lens[j] - 1) drafts; chain_lens[j] = 0 drafts nothing (positions the caller could not
        allocate). device_tables: the step's block tables on the device, current (the batch builder's mirror).
        mask: the drafting sequences' grammar masks (spec/grammar_drafts.py), or None.
        probe: time the graphs without touching the cache (spec/draft_cost.py): every row is staged as padding
        (reads and writes no KV); only for a step that `replays` throughout."""
        items = [it for it in items if it.count > 0]
        if not items:
            return Drafts([], [])
        src: list[int] = []
        next_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        ends: list[int] = []  # per drafting item: its last pass row, the row its draft 1 is read at
        d_rows: list[int] = []
        d_pos: list[int] = []
        for it in items:
            src.extend(range(it.start, it.start + it.count))
            next_ids.extend(it.next_ids)
            positions.extend(range(it.context_len, it.context_len + it.count))
            rows.extend([it.state_row] * it.count)
            if it.drafts:
                ends.append(len(src) - 1)
                d_rows.append(it.state_row)
                d_pos.append(it.context_len + it.count - 1)
        t, b = len(src), len(ends)
        masked = {j for j in range(b) if mask is not None and mask.constrains(j)}
        g = self.graphs
        pb = g.pass_bucket(t) if g is not None else None
        cb = g.chain_bucket(b) if g is not None and b and len(masked) < b else None
        if probe and (pb is None or (b and cb is None)):
            raise ValueError(f"MTPDrafter.run(probe=True) needs graphs for {t} pass rows and {b} drafting sequences")
        pieces = g is not None and pb is None and not probe and t <= self.max_pieces * g.pass_buckets[-1]
        state = self._pass_in_pieces(hidden, src, next_ids, positions, rows) if pieces else None
        if pb is not None or cb is not None:
            values = {}
            if pb is not None:
                values.update(p_src=src, p_ids=next_ids, p_pos=positions, p_row=[-1] * t if probe else rows)
            if cb is not None:
                values.update(c_src=ends, c_row=[-1] * b if probe else d_rows, c_pos=d_pos,
                              c_len=[0 if j in masked else n for j, n in enumerate(chain_lens)])
            g.stage(values, pb, cb)
        if pb is not None:
            state = g.run_pass(hidden, t, pb)
            self.num_graph_passes += 1
        elif state is None:
            batch = self._batch([it.state_row for it in items], positions, [it.count for it in items],
                                [it.context_len for it in items], device_tables)
            ids_dev = tensor_to(next_ids, torch.int64, self.device)
            self._plan_snapshots([(it.state_row, it.context_len, it.count) for it in items])
            try:
                state = self.model.mtp_forward(hidden.index_select(0, tensor_to(src, torch.int64, self.device)),
                                               ids_dev, batch, self.caches)
            finally:
                self._plan_snapshots(None)  # the chain's lookahead positions are rewritten later: no snapshots
            self.num_eager_passes += 1
        if not b:
            return Drafts([], [])
        tokens: list[list[int]] = [[] for _ in range(b)]
        confs: list[list[float]] = [[] for _ in range(b)]
        if cb is not None:
            links = max((n for j, n in enumerate(chain_lens) if j not in masked), default=0)
            if links > 0:
                ids, conf = g.run_chain(state, b, cb, links)
                ids_h, conf_h = ids[:, :links].tolist(), conf[:, :links].tolist()  # the step's one read-back
                self.num_host_reads += 1
                for j, n in enumerate(chain_lens):
                    if j not in masked:
                        tokens[j], confs[j] = ids_h[j][:n], conf_h[j][:n]
                self.num_graph_chains += 1
            eager = sorted(masked)
        else:
            eager = list(range(b))
        eager = [j for j in eager if chain_lens[j] > 0]
        if eager:
            self._chain_eager(state, eager, ends, d_rows, d_pos, chain_lens, device_tables, mask, tokens, confs)
            self.num_eager_chain_seqs += len(eager)
        return Drafts(tokens, confs)

    def _plan_snapshots(self, rows: list[tuple[int, int, int]] | None) -> None:
        """Prefix caching on V4: where the MTP pass saves its rings (rows: (table row, context_len, count) per pass
        request), or None (no snapshot: the chain)."""
        kv = self.snapshot_kv
        if kv is not None and kv.snapshots is not None:
            kv.snapshots.plan = None if rows is None else kv.snapshot_plan_rows(rows)

    def _pass_in_pieces(self, hidden: torch.Tensor, src: list[int], next_ids: list[int], positions: list[int],
                        rows: list[int]) -> torch.Tensor:
        """A pass of more rows than the largest pass graph holds (an MTP-KV catch-up after a long pause:
        spec/mtp_catchup.py keeps up to 4,096 rows), as replays of the pass graphs over consecutive pieces in row
        order. A piece's rows attend over the KV the earlier pieces wrote, as a sequence's later rows in one pass
        attend over its earlier ones (decode rows write their KV before attention reads it), so the states and the
        MTP KV are the one pass's. Why not eagerly: an eager forward at a row count no graph or prefill ran before
        compiles kernels for it (the H200 sweep of 2026-12-06 timed a 256-sequence catch-up step at 567 ms, four
        Triton compiles of 1.38 s in its cell); the replays reuse kernels captured at start-up."""
        g = self.graphs
        size = g.pass_buckets[-1]
        out = g.static.p_out
        state = torch.empty((len(src), out.shape[1]), dtype=out.dtype, device=out.device)
        for lo in range(0, len(src), size):
            hi = min(lo + size, len(src))
            bucket = g.pass_bucket(hi - lo)
            g.stage({"p_src": src[lo:hi], "p_ids": next_ids[lo:hi], "p_pos": positions[lo:hi],
                     "p_row": rows[lo:hi]}, bucket, None)
            state[lo:hi].copy_(g.run_pass(hidden, hi - lo, bucket))
            self.num_graph_passes += 1
        return state

    def _chain_eager(self, state: torch.Tensor, live: list[int], ends: list[int], d_rows: list[int],
                     d_pos: list[int], chain_lens: list[int], device_tables, mask, tokens: list[list[int]],
                     confs: list[list[float]]) -> None:
        """Drafting items `live` (indices into ends / chain_lens) drafted eagerly into tokens / confs: draft 1 at
        their last pass row of `state`, then link l at position d_pos + l from its own state and draft l. Read
        back once at the end, or at every link under a grammar mask (the next link's mask reads the drafts)."""
        state = state.index_select(0, tensor_to([ends[j] for j in live], torch.int64, self.device))
        outs: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        link = 0
        ids = None
        while live:
            if link:  # link l: MTP at position pos + l, from its own state at pos + l - 1 and draft l
                p = [d_pos[j] + link for j in live]
                batch = self._batch([d_rows[j] for j in live], p, [1] * len(live), p, device_tables)
                state = self.model.mtp_forward(state, ids, batch, self.caches)
            logits = mtp_draft_logits(self.model, state)
            if mask is not None:
                logits = mask(live, tokens, logits)
            ids, conf = argmax_confidence(logits, self.pick_op)
            if mask is not None:
                self.num_host_reads += 1
                for j, tok, c in zip(live, ids.tolist(), conf.tolist()):
                    tokens[j].append(tok)
                    confs[j].append(c)
            else:
                outs.append((live, ids, conf))
            link += 1
            keep = [i for i, j in enumerate(live) if chain_lens[j] > link]
            if keep and len(keep) < len(live):
                sel = tensor_to(keep, torch.int64, self.device)
                state, ids = state.index_select(0, sel), ids.index_select(0, sel)
            live = [live[i] for i in keep]
        if outs:
            self.num_host_reads += 1
            flat_ids = torch.cat([o[1] for o in outs]).tolist()
            flat_conf = torch.cat([o[2] for o in outs]).tolist()
            r = 0
            for lv, _, _ in outs:
                for j in lv:
                    tokens[j].append(flat_ids[r])
                    confs[j].append(flat_conf[r])
                    r += 1


def step_pass_rows(sched, emitted: list[list[int]], kv) -> tuple[list[MTPRows], list]:
    """Per scheduled sequence of a step (a SchedulerOutput), the rows whose next token is known after it: the MTP
    pass's input (emitted: the tokens each sequence emitted; kv: the KV manager, for the state rows). Returns the
    rows and their sequences."""
    rows: list[MTPRows] = []
    start = 0
    for item, toks in zip(sched.scheduled, emitted):
        seq, c = item.seq, item.context_len
        q0 = item.num_tokens - len(item.draft)
        if item.samples and toks:
            count = q0 + len(toks) - 1
            next_ids = seq.token_ids_slice(c + 1, c + q0) + toks
        elif item.samples:  # it drew nothing (its grammar mask failed): its last row's next token is unknown
            count = q0 - 1
            next_ids = seq.token_ids_slice(c + 1, c + q0)
        else:
            count = q0
            next_ids = seq.token_ids_slice(c + 1, c + q0 + 1)
        rows.append(MTPRows(start, count, next_ids, c, bool(item.samples and toks), kv.state_slot(seq.seq_id)))
        start += item.num_tokens
    return rows, [it.seq for it in sched.scheduled]
