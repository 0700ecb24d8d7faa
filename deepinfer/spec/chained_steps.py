"""Async scheduling of speculative steps: the next one-sync step launched before the last one's read-back, its inputs
taken from the last step's results on the device.

Why. With overlapped output (spec/overlap.py) a one-sync step's text and the engine's outputs already run while the
device works, but the next step is still scheduled, built and launched after the last one's read-back: the device
idles for the host's schedule, batch build and launches every step. Async scheduling (sched/step_pipeline.py)
removes that gap for plain decoding by scheduling step N + 1 before step N's token is on the host; a speculative
step N + 1 also depends on how many of step N's drafts were accepted, which moves its positions.

What (`_chain`, called with step N in flight): step N + 1 is placed on the host as if every draft of step N were
accepted (sequence b at context c_b + d_b + 1, d_b its drafts in N), and corrected on the device by r_b = d_b - a_b
(a_b: N's accepted count, a device tensor of N's verification): each of its 1 + L rows (L: the chain N drafted)
takes position c_b + d_b + 1 + j - r_b, its KV slot from the device's block tables at that position, decode-row
lengths from it; its input ids are N's last emitted token (N's draw at row start_b + a_b) and N's L drafts (the
chain graph's output); the one-sync pass's and chain's staged inputs get the same shift (p_pos, f_ctx, f_room) and
the drafts as f_tok. Then the forward, the draw and `OneSyncStep.launch`, and only then step N's read-back and
output processing (which also corrects the host's view: each item's context_len, its drafts, its confidences) and
N's text, while the device runs N + 1. So each step costs about max(host, device) instead of their sum.

Same tokens as sync: N + 1 verifies the drafts a sync step would (all L: static k verifies every draft it holds,
but near max_tokens, where the sync step verifies fewer: the target's token at each position is the same either
way, and output processing stops at max_tokens) at the positions it would, over the same KV; a greedy draw depends
on the logits only, a seeded or random row's on its (seed, position) key, hashed on the device from the corrected
position (`Sampler.sample(positions=...)`, rng.py `row_keys_device`: bit-equal to the host's key). What is
different: a sequence that N finishes (EOS, a stop string, max_tokens) may be in N + 1, whose rows of it are then
dropped (a finished sequence takes no tokens), and its blocks, freed when N resolves, are rewritten only by later
steps (one stream), as sched/step_pipeline.py argues for plain async scheduling.

KV: N + 1's rows and its chain's lookahead are covered for the worst case (every draft of N and of N + 1
accepted) before it is built; while it is in flight, N's rollback keeps those blocks (`_process`'s keep), and N + 1's
own resolution rolls back to its accepted tokens. Blocks are keyed in the prefix cache only up to verified tokens.

The confidence scheduler: a chained step's budget is the policy's plan (`plan_drafting`, from past steps only:
non-anticipating), every sequence verifying the planned chain; its per-draft admission (SlotPolicy.counts), which
reads the confidences of the drafts it verifies, is not run: those confidences are still on the device. Where the
policy plans after the draw (a probe's verification, a pause) or plans a pause, a probe or an exploration, the step
runs sync with the plan already made (`_preplanned`).

When (`_why_not_chained`, `_chain`; otherwise the step in flight is resolved first and the next step runs as before):
every running sequence was in step N (those of N that finished since N's launch are left out: N + 1 gathers the
kept sequences' rows of N's device results), nothing waits; no sequence with penalties (their counts are host tokens) or a
grammar (its mask follows host tokens), every one past min_tokens (its mask counts host tokens), with room for N's
and N + 1's tokens within max_model_len; N's chain as long as planned for every sequence (its room covered); the
worst-case KV covered without preempting; the decode graphs and the MTP graphs cover the step's rows (the eager
paths read host lengths). Each fallback is counted by reason (`chain_fallbacks`).

Where: `async_scheduling=True` (`--async-scheduling`, `DEEPINFER_ASYNC_SCHEDULING=1`) on an MTP engine whose steps
run one-sync with overlapped output, on one rank; refused at start-up otherwise (engine/startup.py:
`chaining_refusals`; spec/setup.py when no MTP graphs came).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.backend import ForwardBatch, token_slots
from deepinfer.errors import DeepInferError
from deepinfer.sched.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer.spec.draft_slots import cover_tokens
from deepinfer.spec.one_sync import OneSyncPlan
from deepinfer.spec.overlap import StepRecord
from deepinfer.spec.verify_sampling import verified_rows
from deepinfer.worker.transfer import to_device

if TYPE_CHECKING:
    from deepinfer.spec.pipeline import SpecStepPipeline

# the per-step fields of SpecStepPipeline a step sets at its launch and reads at its resolution
STEP_FIELDS = ("_failed", "_launch_parts", "_drafted", "_caught_up", "_one_sync_ran", "_chain_plan", "_deferred_s",
               "_draft_s")


class ChainedSteps:
    """Methods of SpecStepPipeline (self is one): the next step launched on the device results of the one in flight."""

    def _step_fields(self: SpecStepPipeline) -> dict:
        return {name: getattr(self, name) for name in STEP_FIELDS}

    def _set_step_fields(self: SpecStepPipeline, fields: dict) -> None:
        for name, value in fields.items():
            setattr(self, name, value)

    def _fallback(self: SpecStepPipeline, why: str) -> None:
        self.chain_fallbacks[why] = self.chain_fallbacks.get(why, 0) + 1

    def _why_not_chained(self: SpecStepPipeline, prev: StepRecord) -> tuple[str | None, list[int]]:
        """Why the step after `prev` (in flight) cannot be launched before prev's read-back (module docstring), as
        `chain_fallbacks` counts it, or None when it can; and which of prev's sequences it takes (their indices in
        prev, in order): the running ones, where the others have finished since prev was launched."""
        sch, items, plan = self.scheduler, prev.sched.scheduled, prev.plan
        if sch.waiting:
            return "waiting", []
        if not sch.running:
            return "idle", []  # (nothing to chain: not a fallback)
        index = {id(it.seq): i for i, it in enumerate(items)}
        keep = [index.get(id(s), -1) for s in sch.running]
        kept = set(keep)
        if -1 in kept or any(not it.seq.finished for i, it in enumerate(items) if i not in kept):
            return "batch_changed", []
        links = plan.links
        if len(keep) * (1 + links) > sch.max_num_batched_tokens:
            return "token_budget", []
        for i in keep:
            it, room = items[i], plan.rooms[i]
            seq, d = it.seq, len(it.draft)
            p = seq.params
            if seq.finished:
                return "finished", []
            if seq.grammar is not None or seq.request.needs_host_tokens:
                return "sampling", []
            outs = len(seq.output_token_ids)
            if outs < p.min_tokens:
                return "min_tokens", []
            if room < d + links:
                return "room", []
        return None, keep

    @torch.inference_mode()
    def _chain(self: SpecStepPipeline, prev: StepRecord) -> StepRecord | None:
        """Launch the step after `prev` (in flight) from prev's device results; None (nothing launched, nothing
        changed but KV covered for it) where it cannot be (counted in chain_fallbacks)."""
        why, keep = self._why_not_chained(prev)
        if why is not None:
            return None if why == "idle" else self._fallback(why)
        t_start = time.perf_counter()
        plan0 = prev.plan
        items = [prev.sched.scheduled[i] for i in keep]
        links, b = plan0.links, len(items)
        policy = self.policy
        if policy.adaptive and (not policy.plans_before_the_draw() or len(self.paused_rows)):
            return self._fallback("plan")  # (a probe's verification, a pause: the sync step plans after its draw)
        self._fold_unless_holding(b)
        want = policy.plan_drafting(b)  # (static k: k; adaptive: its plan, from past steps only)
        if want < 1 or not self._uniform_chain(b):  # a pause, a probe or an exploration: the sync step runs it
            self._preplanned = want
            return self._fallback("plan")
        g, kv, runner = self.one_sync.graphs, self.scheduler.kv, self.runner
        # N + 1's rows and its chain's lookahead inside max_model_len, every draft accepted (max_tokens needs no
        # check: output processing stops there)
        if any(it.context_len + len(it.draft) + 1 + links + want > kv.max_model_len for it in items):
            self._preplanned = want
            return self._fallback("length")
        t = b * (1 + links)
        pass_bucket, chain_bucket = g.pass_bucket(t), g.chain_bucket(b)
        if pass_bucket is None or chain_bucket is None:
            self._preplanned = want
            return self._fallback("mtp_graphs")
        for it in items:  # N's tokens and N + 1's rows and chain, every draft accepted, without preempting anyone
            if not cover_tokens(kv, it.seq, len(it.draft) + 1 + links + want):
                self._preplanned = want
                return self._fallback("kv")
        t0 = time.perf_counter()
        ctx = [it.context_len + len(it.draft) + 1 for it in items]  # N + 1's context if N accepted everything
        tab = [kv.state_slot(it.seq.seq_id) for it in items]
        batch, row_drafts, pos, rej = self._chained_batch(prev, keep, ctx, tab, links)
        if batch is None:
            self._preplanned = want
            return self._fallback("decode_graphs")
        fields = self._step_fields()  # (N's: its resolution reads them)
        new_items = [ScheduledSeq(it.seq, 1 + links, c, [0] * links) for it, c in zip(items, ctx)]
        rec = StepRecord(SchedulerOutput(new_items), {}, t_start, t0, t0, wait0=0.0)
        rec.emitted, rec.logprobs = [[] for _ in new_items], [None] * b
        self._failed, self._launch_parts, self._drafted, self._caught_up = {}, {}, (0, 0), False
        self._one_sync_ran, self._chain_plan, self._deferred_s, self._draft_s = True, want, 0.0, None
        self.policy_steps += 1
        t_forward = time.perf_counter()
        hidden = runner.run_model(batch)
        t_stage = time.perf_counter()
        plan = OneSyncPlan(t, b, links, want, pass_bucket, chain_bucket,
                           starts=[i * (1 + links) for i in range(b)], rooms=[links + want] * b)
        self._stage_chained(plan, ctx, tab, row_drafts, pos, rej)
        t_sample = time.perf_counter()
        logits = runner.model.compute_logits(hidden).float()
        sampling = list(range(b))
        try:  # the draws keyed by the rows' device positions (seeded and random rows: Sampler.sample)
            # (a row at position p draws the token at p + 1: SamplingRow.position)
            sample = runner.sampler.sample(logits, verified_rows(new_items, sampling), None, positions=pos + 1)
        except Exception:  # noqa: BLE001 - the sync step isolates the request whose rows raise (verify_sampling.py)
            self._set_step_fields(fields)  # nothing of this step is kept: its rows' KV is rewritten by the sync step
            self._preplanned = want
            return self._fallback("sampling_error")
        t_launch = time.perf_counter()
        rec.pending, rec.plan, rec.sampling = self.one_sync.launch(plan, sample, hidden), plan, sampling
        rec.t_launched = time.perf_counter()
        rec.launch_s = rec.t_launched - t_launch
        rec.keep = {it.seq.seq_id: c + links + want for it, c in zip(items, ctx)}
        self._launch_parts = {"build": t_forward - t0, "forward": t_stage - t_forward, "stage": t_sample - t_stage,
                              "sample": t_launch - t_sample}
        rec.fields = self._step_fields()
        self._set_step_fields(fields)  # back to N's until it resolves
        self.num_chained_steps += 1
        self.num_chained_without_finished += len(keep) < len(prev.sched.scheduled)
        return rec

    def _take_chained(self: SpecStepPipeline, rec: StepRecord) -> None:
        """After the step before `rec` resolved: rec's items take their true contexts (the sequences'
        num_computed_tokens now), the drafts and confidences they verify (booked by that resolution: taken, as a
        sync step's draft slots take them), and rec goes in flight with its own per-step fields."""
        for i, it in enumerate(rec.sched.scheduled):
            seq = it.seq
            held = self.book.take(seq)
            if seq.finished:
                continue
            if held is None or len(held.tokens) != len(it.draft):
                raise DeepInferError(f"chained speculative step: {seq.seq_id!r} verifies {len(it.draft)} drafts on the "
                                     f"device, the host holds {None if held is None else len(held.tokens)}")
            it.context_len = seq.num_computed_tokens
            it.draft, rec.conf[i] = held.tokens, held.confidence
        rec.wait0 = self.one_sync.wait_seconds
        self._set_step_fields(rec.fields)
        self._in_flight = rec

    def _chained_batch(self: SpecStepPipeline, prev: StepRecord, keep: list[int], ctx: list[int], tab: list[int],
                       links: int):
        """N + 1's forward as decode rows of N's sequences `keep` (their indices in N), corrected on the device by
        N's rejected counts (module docstring): (the batch, or None where no decode graph replays it; each row's
        draft of N (0 at a sequence's first row), its position, each sequence's rejected drafts in N)."""
        runner, kv = self.runner, self.scheduler.kv
        builder, dev = runner.builder, runner.device
        items, b, w = [prev.sched.scheduled[i] for i in keep], len(ctx), 1 + links
        t = b * w
        pos_opt = (np.repeat(np.asarray(ctx, dtype=np.int64), w) + np.tile(np.arange(w, dtype=np.int64), b))
        host = np.concatenate([pos_opt, np.repeat(np.arange(b, dtype=np.int64), w),
                               np.tile(np.arange(w, dtype=np.int64), b), np.asarray(tab, dtype=np.int64),
                               np.asarray([len(it.draft) for it in items], dtype=np.int64),
                               np.asarray([prev.plan.starts[i] for i in keep], dtype=np.int64),
                               np.asarray(keep, dtype=np.int64)])
        packed = to_device(torch.from_numpy(host), dev)
        pos_d, seq_d, j_d, tab_d, dlen_d, start_d, keep_d = packed.split_with_sizes([t, t, t, b, b, b, b])
        # (N's per-sequence device results, rows of N's order: the kept ones; all of them, in order, most steps)
        whole = len(keep) == len(prev.sched.scheduled)
        acc = self.one_sync.verify.accepted[:b] if whole else self.one_sync.verify.accepted.index_select(0, keep_d)
        rej = dlen_d - acc  # N's rejected drafts per sequence
        last = prev.pending.sample.token_ids.index_select(0, start_d + acc)  # N's last emitted token
        out_ids = self.one_sync.graphs.static.out_ids
        drafts = out_ids[:b, :links] if whole else out_ids.index_select(0, keep_d)[:, :links]
        pos = pos_d - rej.index_select(0, seq_d)
        row_drafts = torch.where(j_d == 0, 0, drafts[seq_d, (j_d - 1).clamp(min=0)])  # (f_tok of the MTP pass too)
        ids = torch.where(j_d == 0, last.index_select(0, seq_d), row_drafts)
        builder.sync_tables()  # (the worst-case cover's new blocks)
        rows = tab_d.index_select(0, seq_d)
        longest = int(pos_opt.max()) + 1
        block_tables, slot_mapping = {}, {}
        req = torch.arange(t, dtype=torch.int64, device=dev)
        for name, spec in builder.specs.items():
            width = max(kv.table_len(spec, longest), 1)
            block_tables[name] = builder.mirror[name][:, :width].index_select(0, rows)
            slot_mapping[name] = token_slots(block_tables[name], req, pos, spec.tokens_per_entry, kv.block_size)
        pos_host = pos_opt.tolist()
        batch = ForwardBatch(
            input_ids=ids, positions=pos, query_start_loc=torch.arange(t + 1, dtype=torch.int32, device=dev),
            seq_lens=(pos + 1).to(torch.int32), context_lens=pos.to(torch.int32), block_tables=block_tables,
            slot_mapping=slot_mapping, logits_indices=req, query_lens_cpu=[1] * t,
            seq_lens_cpu=[p + 1 for p in pos_host], context_lens_cpu=pos_host,  # (upper bounds: N all accepted)
            state_slots=None, state_slots_cpu=[], block_size=kv.block_size)
        graph_runner = runner.graph_runner
        if graph_runner is None or not graph_runner.can_run(batch):
            return None, None, None, None
        return batch, row_drafts, pos, rej

    def _stage_chained(self: SpecStepPipeline, plan: OneSyncPlan, ctx: list[int], tab: list[int],
                       row_drafts: torch.Tensor, pos: torch.Tensor, rej: torch.Tensor) -> None:
        """The one-sync pass's and chain's inputs of N + 1 (OneSyncStep.stage's, placed as if N accepted everything),
        then corrected on the device: positions, contexts and rooms by N's rejected counts, N's drafts as f_tok."""
        b, t, links, want = plan.b, plan.t, plan.k, plan.links
        w = 1 + links
        g = self.one_sync.graphs
        g.stage_all([list(range(t)), [0] * t, [c + j for c in ctx for j in range(w)], [r for r in tab for _ in range(w)],
                     [i for i in range(b) for _ in range(w)], list(range(w)) * b, [0] * t],
                    [plan.starts, tab, ctx, [want] * b, plan.starts, [links] * b, ctx, plan.rooms],
                    plan.pass_bucket, plan.chain_bucket)
        st = g.static  # (the pass's rows are the forward's: one per verify row, in order)
        st.seg("p_pos")[:t].copy_(pos)
        st.seg("f_ctx")[:b].sub_(rej)
        st.seg("f_room")[:b].add_(rej)
        st.seg("f_tok")[:t].copy_(row_drafts)  # (N's chain, gathered before this step's chain rewrites it)
