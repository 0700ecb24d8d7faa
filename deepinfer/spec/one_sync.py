"""The one-sync speculative step: verification, the MTP pass and the chain stay on the device, and the host reads
the step's results back in ONE copy.

Why. Speculative engines run sync (async scheduling with speculation is refused). The host path reads the draw
back, verifies on the host, builds the MTP pass's inputs from the accepted counts, stages them, replays the pass and
the chain and reads the drafts back: two waits for the device per step, each exposing the launch latency and the
device time, with host work between them during which the device idles. On the H200 (2026-12-03, embedded model,
k = 3, concurrency 1) a plain decode step cost ~0.53 ms and a k = 3 step 1.3-1.8 ms, host-bound (device busy 11.9
of 57.9 ms under the profiler).

What runs where, for a step that qualifies (`OneSyncStep.prepare`):
1. host-known, before the draw: whether the step qualifies (`qualify`, before the forward); then, once the forward
   is launched (so the device runs it meanwhile: before 2026-12-05 this ran before the batch was built, ~80 us of
   host time a step at one sequence on this CPU with the device idle), `stage`: each sequence's KV room for its
   chain's lookahead is covered for the worst case, every draft accepted, without preempting anyone
   (`cover_room`; the new blocks reach the device's tables with a table sync before the pass), and the pass's and
   chain's host-known inputs are staged with the MTP graphs' inputs, in their one host-to-device copy: every verify
   row r of sequence b (j = 0..d_b: its real token and its d_b drafts) as a pass row at position c_b + j, with b, j
   and its draft; per sequence its first row, drafts verified, context length, room and wanted chain length;
2. after the draw (`finish`, device, one replay of a captured graph per pass bucket: spec/one_sync_graphs.py, since
   2026-12-04; eager ops before): the accepted counts of `greedy_verify`'s rule over the chosen tokens and the staged
   drafts (`greedy_accepted`, the function greedy_verify counts with: drafts accepted while they equal the target's
   token, then the target's token; the emitted tokens are the draw's rows start_b .. start_b + a_b); from each
   accepted count a_b: the token after pass row j is the chosen token there (for j <= a_b, the emitted token j:
   exactly the host path's next ids), rows past a_b become padding (KV table row -1: read nothing, write nothing,
   so the pass writes the MTP KV of positions c_b .. c_b + a_b, as the host path's pass over a_b + 1 rows does);
   draft 1 is read at row start_b + a_b (position c_b + a_b); the chain length is min(wanted, room_b - a_b), the
   host path's rule (`SpecStepPipeline._chain_room`: the lookahead must be allocated and inside max_model_len);
3. the pass graph and the chain graph (one replay for a full chain of k, backend/mtp_graph_runner.py);
4. one device-to-host copy behind one event: the chosen tokens, accepted counts, chain lengths, drafts and
   confidences (and the sampler's logprob tensors). `num_host_reads` counts these waits.

Output is unchanged: the emitted tokens are the host path's (same draw, same rule); the drafts are the host path's
up to the pass's bucket size (the pass runs over every verify row, its padded rows masked: decode rows are
independent, so a row's MTP state is the same up to the kernels' batch-size-dependent rounding) and up to the room:
covering the worst case may allocate one block more than the accepted run needs (given back by the step's rollback,
as the host path's lookahead blocks are), so under memory pressure a later sequence's chain may be shorter.

Which steps qualify: every scheduled sequence is a decode or a verify row (no prompt chunk) and samples; none has a
grammar (its drafts are drawn under its mask, link by link, on the host: spec/grammar_drafts.py) and none failed its
draw; every sequence drafts the step's planned chain (static k, or the confidence scheduler's plan, made before the
forward, when it is not a pause, nor a probe or exploration of a subset: SpecStepPipeline._uniform_chain); nothing
is kept for a catch-up; the MTP graphs cover the step's rows and sequences. Every other step takes the host path, as before (spec/pipeline.py). Stop strings, EOS and max_tokens
inside an accepted run are applied by output processing after the read-back, as on the host path (whose pass also
ran over the whole accepted run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.sample.sampler import DeviceSample, SamplerOutput
from deepinfer.spec.draft_slots import cover_tokens
from deepinfer.spec.one_sync_graphs import VerifyGraphs
from deepinfer.worker.transfer import HostCopy


@dataclass
class OneSyncPlan:
    """A qualifying step's shape (host-known before its forward)."""

    t: int  # verify rows (= pass rows)
    b: int  # sequences (each verifies, and drafts)
    k: int  # most drafts one sequence verifies this step
    links: int  # the chain length wanted (the policy's k)
    pass_bucket: int
    chain_bucket: int
    starts: list[int] = field(default_factory=list)  # each sequence's first verify row
    rooms: list[int] = field(default_factory=list)  # each sequence's room past its context (`cover_room`), staged


@dataclass
class PendingRead:
    """A one-sync step launched (`OneSyncStep.launch`): its device work and read-back copy queued, not waited for."""

    plan: OneSyncPlan
    sample: DeviceSample
    copy: HostCopy


@dataclass
class OneSyncResult:
    """What the one read-back brings, on the host."""

    out: SamplerOutput  # the draw of every verify row (token ids, logprobs)
    num_accepted: list[int]
    emitted: list[list[int]]  # per sequence: its accepted drafts, then the target's token
    drafts: list[list[int]]  # per sequence: the next step's drafts (its chain length of them)
    confidence: list[list[float]]


def cover_room(kv, seq, drafts: int, want: int, max_model_len: int) -> int:
    """Tokens past the sequence's num_computed_tokens (its context before this step) the KV covers for the step's
    verify rows and its chain's lookahead in the worst case (all `drafts` accepted, a chain of `want`), covered
    without preempting anyone; shortened where the cache has no room, capped by max_model_len. At least 1 + drafts
    (the verify rows, covered by the draft slots)."""
    c = seq.num_computed_tokens
    top = min(drafts + want, max_model_len - c)
    while top > 1 + drafts and not cover_tokens(kv, seq, top):
        top -= 1
    return max(top, 1 + drafts)


class OneSyncStep:
    """The one-sync step over an MTP drafter's captured graphs (backend/mtp_graph_runner.py)."""

    def __init__(self, graphs, device: torch.device):
        self.graphs = graphs
        self.device = device
        self.num_steps = 0  # steps run this way
        self.num_host_reads = 0  # waits for the device (one per step)
        self.wait_seconds = 0.0  # host seconds spent in those waits (spec/step_phases.py's "wait")
        # step 2 (verification and derivation) captured per pass bucket (spec/one_sync_graphs.py)
        self.verify = VerifyGraphs.capture(graphs, device)

    def prepare(self, items, kv, want: int, max_model_len: int) -> OneSyncPlan | None:
        """`qualify`, then `stage` (both halves at once: what a caller that has nothing to overlap them with runs)."""
        plan = self.qualify(items, want)
        if plan is not None:
            self.stage(plan, items, kv, max_model_len)
        return plan

    def qualify(self, items, want: int) -> OneSyncPlan | None:
        """For the step's scheduled sequences (ScheduledSeq, the draft slots added): None unless every one is a
        decode or a verify row that samples without a grammar and the graphs cover the step (module docstring),
        else the step's plan. Host work only, a pass over the items: what must be known before the forward (the
        logits rows are the forward's rows). The rooms and the staging (`stage`) wait until the forward is
        launched: only the pass and the chain read them, and until then the device would idle behind them."""
        if not items or want < 1:
            return None
        t = 0
        k = 0
        for it in items:
            d = len(it.draft)
            if not it.samples or it.num_tokens - d != 1 or it.seq.grammar is not None:
                return None
            t += 1 + d
            k = max(k, d)
        g = self.graphs
        pb, cb = g.pass_bucket(t), g.chain_bucket(len(items))
        if pb is None or cb is None:
            return None
        return OneSyncPlan(t, len(items), k, want, pb, cb)

    def stage(self, plan: OneSyncPlan, items, kv, max_model_len: int) -> None:
        """Cover each sequence's room and stage the host-known inputs of the pass and the chain (one copy); fills
        plan.starts. The rooms' new blocks reach the device's tables with the caller's next table sync, which must
        come before `finish` (the chain reads them)."""
        want = plan.links
        p_pos: list[int] = []
        p_row: list[int] = []
        f_seq: list[int] = []
        f_j: list[int] = []
        f_tok: list[int] = []
        starts = plan.starts
        starts.clear()
        rows: list[int] = []
        ctxs: list[int] = []
        dlens: list[int] = []
        rooms = plan.rooms
        rooms.clear()
        state_slot = kv.state_slot
        for b, it in enumerate(items):
            d, c, row = len(it.draft), it.context_len, state_slot(it.seq.seq_id)
            starts.append(len(p_pos))
            p_pos.extend(range(c, c + 1 + d))
            p_row.extend([row] * (1 + d))
            f_seq.extend([b] * (1 + d))
            f_j.extend(range(1 + d))
            f_tok.append(0)  # the row of the real token (its draft is the first drafted row's)
            f_tok.extend(it.draft)
            rows.append(row)
            ctxs.append(c)
            dlens.append(d)
            rooms.append(cover_room(kv, it.seq, d, want, max_model_len))
        t = plan.t
        # in buffer order: p_src, p_ids, p_pos, p_row, f_seq, f_j, f_tok; c_src, c_row, c_pos, c_len, f_start, f_dlen,
        # f_ctx, f_room (backend/mtp_graph_runner.py: PASS_FIELDS + PASS_EXTRA, CHAIN_FIELDS + CHAIN_EXTRA)
        self.graphs.stage_all([list(range(t)), [0] * t, p_pos, p_row, f_seq, f_j, f_tok],
                              [starts, rows, ctxs, [want] * len(items), starts, dlens, ctxs, rooms],
                              plan.pass_bucket, plan.chain_bucket)

    @torch.inference_mode()
    def finish(self, plan: OneSyncPlan, sample: DeviceSample, hidden: torch.Tensor,
               while_waiting: Callable[[], None] | None = None) -> OneSyncResult:
        """Verify, pass and chain on the device after the draw (`sample`: one row per verify row, in order; the
        drafts are the staged f_tok; hidden: the forward's hidden states, row r = verify row r), then the one
        read-back (while_waiting runs before it, as the device works). The verification
        and derivation replay verify[pass bucket] (spec/one_sync_graphs.py); the emitted tokens are the draw's rows
        start .. start + accepted (the accepted drafts equal the draw there), which the read-back brings anyway.
        `launch` then `collect`: what an overlapped step (spec/pipeline.py) calls apart, across engine calls."""
        pending = self.launch(plan, sample, hidden)
        if while_waiting is not None:  # host work that needs nothing of this step, while the device runs it
            while_waiting()
        return self.collect(pending)

    @torch.inference_mode()
    def launch(self, plan: OneSyncPlan, sample: DeviceSample, hidden: torch.Tensor) -> PendingRead:
        """`finish`'s device work and its read-back's copy, queued; nothing waits for the device."""
        g = self.graphs
        t, b, links = plan.t, plan.b, plan.links
        chosen = sample.token_ids
        if chosen.shape[0] != t:
            raise ValueError(f"OneSyncStep.finish: a draw of {chosen.shape[0]} rows for {t} verify rows")
        acc = self.verify.run(chosen, plan.pass_bucket)[:b]
        c_len = g.static.seg("c_len")[:b]
        state = g.run_pass(hidden, t, plan.pass_bucket)
        ids, conf = g.run_chain(state, b, plan.chain_bucket, links)
        ints = torch.cat([chosen, acc, c_len, ids[:, :links].reshape(-1)])
        copy = HostCopy([ints, conf[:, :links].contiguous(), *sample.logprob_tensors], self.device)
        return PendingRead(plan, sample, copy)

    def collect(self, pending: PendingRead) -> OneSyncResult:
        """Wait for a launched step's one read-back and unpack it."""
        plan, sample = pending.plan, pending.sample
        t, b, links = plan.t, plan.b, plan.links
        t0 = time.perf_counter()
        host = pending.copy.wait()
        self.wait_seconds += time.perf_counter() - t0
        self.num_host_reads += 1
        self.num_steps += 1
        flat = host[0].tolist()
        num_acc, lens = flat[t : t + b], flat[t + b : t + 2 * b]
        o = t + 2 * b
        conf_h = host[1].tolist()
        drafts = [flat[o + i * links : o + i * links + n] for i, n in enumerate(lens)]
        return OneSyncResult(out=sample.output([host[0][:t], *host[2:]]), num_accepted=num_acc,
                             emitted=[flat[s : s + a + 1] for s, a in zip(plan.starts, num_acc)], drafts=drafts,
                             confidence=[conf_h[i][:n] for i, n in enumerate(lens)])
