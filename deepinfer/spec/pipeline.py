"""One engine step with speculative decoding (sync scheduling): schedule -> draft slots -> one target
forward over every sequence's tokens and drafts -> the sampler at every verified position -> accept
the drafts that match -> the MTP pass and chain (next step's drafts) -> KV of rejected tokens rolled
back -> output processing of several tokens per sequence. The verification's outcomes on the host (emitted tokens,
metrics, calibration) are spec/verify_outcomes.py's; its output processing, rollback and next drafts on the host
spec/step_outputs.py's; where each step's wall time went, spec/step_phases.py's. A one-sync step's read-back is the
next engine call's (spec/overlap.py), and with async scheduling the step after it is launched first
(spec/chained_steps.py).

Verification. The target's token at each verified position is drawn by the ordinary sampler
(penalties, min-tokens mask, temperature, top-k / top-p / min-p, the draw keyed by (seed, position)),
with the drafts before it as context; a draft is accepted while it equals the target's token there,
and the first differing target token (or the bonus one after the last draft) is emitted after the
accepted run (spec/rejection.py: greedy_verify). At T = 0 that is the greedy rule. At T > 0, for the
deterministic drafts MTP gives, it is the rejection rule with a one-hot q: a draft d is accepted with
probability p(d) and otherwise the emitted token is a draw from p restricted to tokens != d; the
emitted token at every position is exactly the draw the sampler makes there without speculation. So
seeded requests give the tokens they give with speculation off, alone or in any batch (up to the
floating-point difference between a verify forward and a decode forward).

Rollback. The target forward wrote KV for every drafted position; a sequence's num_computed_tokens
moves only past its accepted tokens, blocks wholly past them go back to the pool
(KVCacheManager.rollback), and full blocks are keyed in the prefix cache only after that (so no
cached block ever holds a rejected token's KV). A preempted sequence's draft is dropped and it
recomputes as usual (the recompute's MTP pass rebuilds its MTP KV).

Drafters: the MTP module (spec/mtp_drafter.py: its pass and chain run right after verification, on the
step's hidden states, spec/next_drafts.py; in an adaptive pause its decode rows are kept and replayed by the next
pass, spec/mtp_catchup.py) or prompt lookup (spec/ngram.py: after output processing, no model work).

With batch invariance on (the cpu backend's invariant ops compute a token the same way in a prefill
chunk and in a decode), speculation on gives bitwise the tokens and logprobs of speculation off
(tests/spec/test_engine_spec.py).

Structured output: a constrained sequence's draft is cut at its first grammar-forbidden token before the
slots are counted (`_clip`), and every verified position is drawn under the mask of the grammar state after
the drafts before it, all rows in one batched fill (sample/grammar/draft_mask.py); the emitted tokens are
committed to the matcher when output processing appends them. So a structured request gives the tokens it
gives with speculation off, and a drafter's grammar-invalid tokens cost acceptance only.

Backends: cpu, and nvidia (a verify row, 1 + k query tokens on a cached context, through its MLA op's
prefill-with-context path; tests/spec/test_spec_nvidia_interpreter.py). Graphs: a step of decodes and verify
rows replays the decode graphs as decode rows where they cover it (spec/verify_batch.py, spec/setup.py), else
it runs eagerly; a step without drafts replays the decode graph; the MTP pass and chain replay the drafter's own
graphs (backend/mtp_graph_runner.py, through spec/mtp_drafter.py) where they cover the step, else run eagerly.

Async: an adaptive engine's pause steps (plain decodes) run through async scheduling where spec/async_pauses.py
says; with async_scheduling=True one-sync steps chain (spec/chained_steps.py). Not here (refused at start-up,
engine/startup.py: check_speculation): async scheduling where steps cannot chain (chaining_refusals), backends
other than cpu and nvidia, and with several ranks data-parallel replicas (engine/parallel_setup.py; tensor
parallelism runs: every rank runs this step alike over its shard, the adaptive policy's measured times agreed
first, spec/shared_times.py). V4 drafts with its MTP module or n-grams (its window and compressor rings roll back
through the KV manager, docs/speculative.md "V4").
"""

from __future__ import annotations

import time

import torch

from deepinfer import envs
from deepinfer.errors import DeepInferError
from deepinfer.sample.grammar.draft_mask import clip_draft
from deepinfer.sched.request import Sequence
from deepinfer.sched.scheduler import Scheduler, SchedulerOutput
from deepinfer.spec.async_pauses import AsyncPauses
from deepinfer.spec.chained_steps import ChainedSteps
from deepinfer.spec.draft_slots import DraftBook, add_draft_slots
from deepinfer.spec.grammar_drafts import verify_masks
from deepinfer.spec.metrics import SpecMetrics
from deepinfer.spec.mtp_catchup import PausedRows
from deepinfer.spec.mtp_drafter import MTPDrafter
from deepinfer.spec.next_drafts import NextDrafts
from deepinfer.spec.ngram import NgramDrafter
from deepinfer.spec.one_sync import OneSyncPlan, OneSyncResult, OneSyncStep
from deepinfer.spec.overlap import OverlappedSteps, StepRecord
from deepinfer.spec.shared_times import SharedTimes
from deepinfer.spec.slot_policy import SlotPolicy
from deepinfer.spec.step_outputs import StepOutputs
from deepinfer.spec.step_phases import StepPhases
from deepinfer.spec.verify_batch import VerifyShapes
from deepinfer.spec.verify_outcomes import VerifyOutcomes, step_sizes
from deepinfer.spec.verify_sampling import sample_isolated, verified_rows, verify_on_host
from deepinfer.text.output_processor import OutputProcessor
from deepinfer.worker.model_runner import ModelRunner
from deepinfer.worker.transfer import tensor_to


class SpecStepPipeline(NextDrafts, VerifyOutcomes, StepOutputs, OverlappedSteps, ChainedSteps):
    """The StepPipeline interface (step / drain / has_pending) for speculative decoding: sync, but for the pause
    steps handed to async_pauses (spec/async_pauses.py; None: every step here) and the one-sync steps' read-backs
    left in flight for the next call (spec/overlap.py)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, output_processor: OutputProcessor,
                 drafter: MTPDrafter | NgramDrafter, policy: SlotPolicy, metrics: SpecMetrics, method: str = "mtp"):
        self.scheduler = scheduler
        self.runner = runner
        self.output_processor = output_processor
        self.drafter = drafter
        self.method = method
        self.policy = policy
        self.metrics = metrics
        self.book = DraftBook()
        self.async_scheduling = False  # the speculative steps' mode (pauses: async_pauses)
        self.async_pauses: AsyncPauses | None = None  # set by spec/setup.py where pauses run async
        self._extra_tokens = 0  # tokens appended beyond one per sequence-step (the engine counts them)
        self._next_drafts: list[tuple[Sequence, list[int], list[float]]] = []  # booked after output processing
        self._drafting = True  # whether this step drafts for the next (adaptive mode pauses it)
        self._drafted = (0, 0)  # (sequences, longest chain) this step drafted for (the policy's step timing)
        self._steady_chain = 0  # the chain the last spec-path step drafted for all its sequences (RealizedRates.step)
        self._caught_up = False  # whether this step's MTP pass caught up a pause's rows (not a step the tables price)
        self._one_sync_ran = False  # whether this step ran one-sync (spec/one_sync.py)
        # the chain this step drafts (policy.plan_drafting, once a step: before its draw, `_plan_chain`, or None until
        # after it)
        self._chain_plan: int | None = 0
        self._failed: dict[int, str] = {}  # this step's sequences whose grammar mask failed (index -> error)
        self.step_ended = False  # a request ended in the last processed step (StepOutputs._process)
        self.num_grammar_clipped = 0  # drafted tokens never verified: the grammar forbids them or one before
        self.num_grammar_masked = 0  # MTP drafts drawn under a grammar mask (spec/grammar_drafts.py)
        # the form each step's batch runs in, and counts of the verify steps' forms (spec/verify_batch.py; its
        # decode_rows_eager is set by spec/setup.py for the cpu backend)
        self.shapes = VerifyShapes()
        self.paused_rows = PausedRows()  # decode rows of adaptive pauses, for the MTP-KV catch-up
        # verification, the MTP pass and the chain on the device with one read-back per step (spec/one_sync.py), where
        # the drafter replays graphs and DEEPINFER_SPEC_ONE_SYNC is on; None: every step takes the host path
        graphs = drafter.graphs if isinstance(drafter, MTPDrafter) else None
        self.one_sync = OneSyncStep(graphs, runner.device) if graphs is not None and envs.SPEC_ONE_SYNC.get() else None
        # one-sync steps resolved by the next call, their text made while the device runs the one after (overlap.py)
        self.overlap = self.one_sync is not None and envs.SPEC_OVERLAP_OUTPUT.get()
        self._in_flight: StepRecord | None = None
        self.num_overlapped_steps = 0
        # async scheduling: the next one-sync step launched before the read-back of the one in flight
        # (spec/chained_steps.py; set by spec/setup.py where async_scheduling=True), and why a step was not
        self.chaining = False
        self._preplanned: int | None = None  # an adaptive plan made for a chained step that then could not run
        self.num_chained_steps = 0
        self.num_chained_without_finished = 0  # chained steps that left out sequences finished since the last launch
        self.chain_fallbacks: dict[str, int] = {}
        self.num_host_reads = 0  # the host path's waits for its draw (the drafter counts its own)
        # host seconds of the slot policy (admission, plan, calibration) over policy_steps speculative-path steps:
        # static k pays only the draft slots' bookkeeping; reported by benchmarks/speculative.py
        self.policy_seconds = 0.0
        self.policy_steps = 0
        self._deferred: list = []  # bookkeeping run while the host waits for the device (`_run_deferred`)
        # the adaptive policy's observations, run with those unless the policy holds (spec/settled_steps.py)
        self._policy_log: list = []
        self._policy_waiting = 0  # how many of them waited past a wait for the device (`_fold_unless_holding`)
        self._deferred_s = 0.0  # this step's seconds in `_run_deferred` (its "deferred" phase)
        self._draft_s: float | None = None  # this step's drafting seconds, observed at its end (`_time_drafting`)
        self.times = SharedTimes()  # the policy's measured times agreed over the tp ranks (spec/setup.py sets it)
        self.phases = StepPhases()  # where the steps' wall time went (spec/step_phases.py; benchmarks print it)

    def host_reads(self) -> int:
        """Waits for the device so far: the host path's draws and drafts, and the one-sync steps' read-backs."""
        drafter = getattr(self.drafter, "num_host_reads", 0)
        return self.num_host_reads + drafter + (self.one_sync.num_host_reads if self.one_sync is not None else 0)

    @property
    def num_sync_fallbacks(self) -> int:
        return self.async_pauses.inner.num_sync_fallbacks if self.async_pauses is not None else 0

    def has_pending(self) -> bool:
        return self._in_flight is not None or (self.async_pauses is not None and self.async_pauses.has_pending())

    def drain(self) -> list[Sequence]:
        done = self._resolve() if self._in_flight is not None else []
        self._flush_texts(done)
        done += self.async_pauses.drain() if self.async_pauses is not None else []
        self.flush_if_idle()  # (the step in flight was the last)
        return done

    def stats_fields(self) -> dict:
        """The EngineStats spec_* fields, as of the deferred bookkeeping run so far: a step's metrics land at the
        next wait for the device, or when the engine idles (`flush_if_idle`). Reading them runs nothing: the
        server reads EngineStats after every step and a parallel engine's tp rank 0 after every step (its replica
        report); run there, the deferred work (calibration, the policy's observations) left the next step's wait
        for the host's critical path, and on tp rank 0 only, a step before the other ranks ran it, so that the
        ranks' admissions and plans, which read it, could part."""
        return {**self.metrics.stats_fields(self.method, self.async_pauses.num_steps if self.async_pauses else 0),
                "spec_overlapped_steps": self.num_overlapped_steps, "spec_chained_steps": self.num_chained_steps}

    def flush_if_idle(self) -> None:
        """Run the deferred bookkeeping when no request is left (every rank reaches this at the same point: the
        end of a step, a delegated async pause step or a drain, an abort)."""
        if (self._deferred or self._policy_log) and not self.scheduler.has_unfinished():
            self._run_deferred(fold=True)

    def take_extra_tokens(self) -> int:
        n, self._extra_tokens = self._extra_tokens, 0
        return n

    def step(self) -> list[Sequence]:
        self.book.prune()
        self.paused_rows.prune()
        if self._in_flight is not None and self.chaining:  # async scheduling: the next step first (chained_steps.py)
            nxt = self._chain(self._in_flight)
            if nxt is not None:
                done = self._resolve(keep=nxt.keep)
                self._take_chained(nxt)
                self._flush_texts(done)  # while the device runs the chained step
                self._run_deferred()
                return done
        done = self._resolve() if self._in_flight is not None else []  # (the last call's overlapped step)
        pauses = self.async_pauses
        if pauses is not None:
            if pauses.delegable():
                self._flush_texts(done)  # (before the pause's step appends more to these sequences)
                got = done + pauses.step()
                self.flush_if_idle()  # (the last spec-path step's bookkeeping, once the pause's last step resolved)
                return got
            done += pauses.drain()  # the spec path starts with every token on the host
        got = done + self._step()
        self._flush_texts(done)  # (a step in flight: while the device runs it, as its bookkeeping below)
        if self._in_flight is not None:
            self._run_deferred()
        return got

    def _step(self) -> list[Sequence]:
        """Schedule and launch a step; resolve it now, or (an overlapped one-sync step) in the next call."""
        rec = self._begin()
        if rec is None:
            return []
        if rec.pending is not None:
            self._in_flight = rec
            return []
        return self._end(rec)

    def _begin(self) -> StepRecord | None:
        t_start = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.empty:
            if self.scheduler.has_unfinished():
                raise DeepInferError(
                    f"scheduler made no progress with {len(self.scheduler.waiting)} waiting and "
                    f"{len(self.scheduler.running)} running sequences (KV cache or token budget too small)")
            return None
        t0 = time.perf_counter()
        samplers = sum(1 for it in sched.scheduled if it.samples)
        self._fold_unless_holding(samplers)
        conf = add_draft_slots(sched, self.book, self.scheduler.kv, self.policy,
                               self.scheduler.max_num_batched_tokens, clip=self._clip)
        self._failed = {}
        self._launch_parts: dict[str, float] = {}  # spec/step_phases.py LAUNCH_PARTS, set by _launch
        self._drafted = (0, 0)
        self._caught_up = False
        self._one_sync_ran = False
        t_slots = time.perf_counter()
        self.policy_seconds += t_slots - t0  # (with the draft slots' KV cover, a few us)
        self.policy_steps += 1
        self._deferred_s = 0.0
        rec = StepRecord(sched, conf, t_start, t0, t_slots,
                         wait0=self.one_sync.wait_seconds if self.one_sync is not None else 0.0)
        self._launch(rec, samplers)
        rec.t1 = time.perf_counter()
        return rec

    def _end(self, rec: StepRecord, keep: dict[str, int] | None = None) -> list[Sequence]:
        """A launched step's outputs on the host: output processing, then the policy's observations and the phases
        (a step's times run from its schedule to here, across the engine calls an overlapped step spans)."""
        sched, t_start, t0, t1 = rec.sched, rec.t_start, rec.t0, rec.t1
        got = self._process(sched, rec.emitted, rec.logprobs, defer_text=rec.pending is not None, keep=keep)
        t2 = now = time.perf_counter()
        num_emitted = None  # (the adaptive policy's: its step times leave output processing out, observe_step)
        draft_s, self._draft_s = self._draft_s, None
        if self.policy.adaptive:  # every time it reads agreed over the tp ranks first (spec/shared_times.py)
            try:  # each sequence's tokens emitted, one byte each (at most k + 1; the realized rates' counts)
                lens = bytes(map(len, rec.emitted))
                num_emitted = sum(lens)
            except ValueError:  # (past 255 tokens a sequence in one step: no counts)
                lens, num_emitted = None, sum(map(len, rec.emitted))
            out_s, step_s, real_s = now - t1, now - t0, now - t_start
            if self.times.comm is not None:  # (one rank: its own times, no list built a step)
                out_s, step_s, real_s, draft_s = self.times.agree([out_s, step_s, real_s,
                                                                   -1.0 if draft_s is None else draft_s])
                draft_s = None if draft_s < 0 else draft_s
        if draft_s is not None:
            self._time_drafting(draft_s)
        tokens, drafts = step_sizes(sched)  # (one pass, for the phases and the policy)
        if num_emitted is not None:  # (adaptive) its observations, deferred to the next wait for the device
            observed = self.policy.observes_step()  # (the same answer on every rank: the policy's state decides)
            self._observe_policy(sched, out_s, step_s, real_s, num_emitted, ended=self.step_ended, observed=observed,
                                 lens=lens, tokens=tokens, drafts=drafts)
        wait = self.one_sync.wait_seconds - rec.wait0 if self.one_sync is not None else 0.0
        kind = "one_sync" if self._one_sync_ran else "catch_up" if self._caught_up else "host" if any(
            self._drafted) or any(it.draft for it in sched.scheduled) else "plain"
        if rec.pending is None:  # (its deferred bookkeeping and read-back wait ran inside its launch)
            launch, overlap = t1 - rec.t_slots - self._deferred_s - wait, 0.0
        else:  # overlapped: "launch" ends with it; "overlap" is the host's time until the read-back: the text and
            # bookkeeping of the step before (less "deferred"), the engine's and the caller's between the calls
            launch = rec.t_launched - rec.t_slots
            overlap = t1 - rec.t_launched - wait - self._deferred_s
        kind = "chained" if rec.fields is not None else "overlapped" if rec.pending is not None else kind
        self.phases.add(kind, {"schedule": t0 - t_start, "slots": rec.t_slots - t0, "launch": launch,
                               "overlap": overlap, "deferred": self._deferred_s, "wait": wait, "process": t2 - t1,
                               "observe": time.perf_counter() - t2, **self._launch_parts}, tokens)
        self.flush_if_idle()  # nothing left to overlap with: the metrics are complete when the engine idles
        return got

    def _plan_chain(self, rec: StepRecord, samplers: int) -> OneSyncPlan | None:
        """The chain this step drafts for the next one, and the one-sync step that runs it (None: the host path).
        Planned here, once the step's forward is launched, where the policy allows it before the draw (static k;
        adaptive drafting steadily: from the calibration, confidences and step times of past steps, one step older
        than planning after the draw; non-anticipating either way), so that the one-sync step can run the adaptive
        mode's chains too; else after the draw (`_draft_next`: a probe's verification, a pause).

        Why after the forward's launch: nothing before it reads the plan (the admission has counted this step's
        slots; the batch is the same whatever chain follows), and the one-sync step needs it only to stage the
        pass's and the chain's inputs (`OneSyncStep.stage`), which follows the launch. Made before it, the plan, its
        hold's checks and the one-sync qualification were host work between the last step's read-back and this
        step's forward, with the device idle: on an H100 (session 40) the adaptive mode's `slots` phase ran 15-25
        us a step longer than static k5's at one sequence. After the launch it runs while the device runs the
        forward, which hides it where the host then waits for the device (the one-sync read-back's `wait` phase);
        on an H100 (session 41) that wait was only 12-18 us a step at 1-16 sequences (host-bound steps: there the
        plan, 22 us a step for static k5 and 38 for the adaptive mode, costs its time wherever it runs). It reads
        what it read before: no observation runs between the admission and here (the waiting ones fold before the
        admission, `_fold_unless_holding`, and the last step's run after this step's launch, `_run_deferred`)."""
        if self._preplanned is not None:  # planned for a chained step that could not run (spec/chained_steps.py)
            self._chain_plan, self._preplanned = self._preplanned, None
        else:
            self._chain_plan = self.policy.plan_drafting(samplers) if self.policy.plans_before_the_draw() else None
        if self.one_sync is None or not self._chain_plan or len(self.paused_rows) or not self._uniform_chain(samplers):
            return None
        return self.one_sync.qualify(rec.sched.scheduled, self._chain_plan)

    def _uniform_chain(self, samplers: int) -> bool:
        """Whether every sequence of the step drafts the planned chain (what the one-sync step stages): static k, or
        an adaptive plan that is neither a probe nor an exploration over fewer than all the sequences."""
        p = self.policy
        return not p.adaptive or samplers <= p.probe_seqs or not (p.probe or p.explore)

    def _clip(self, seq: Sequence, draft: list[int]) -> int:
        """Draft tokens a sequence may verify: all, or for structured output the grammar-allowed prefix."""
        if seq.grammar is None:
            return len(draft)
        n = clip_draft(seq.grammar, seq.output_token_ids, draft, self.runner.grammar_facts.eos_token_ids)
        self.num_grammar_clipped += len(draft) - n
        return n

    # ------------------------------------------------------------ device work

    @torch.inference_mode()
    def _launch(self, rec: StepRecord, samplers: int) -> None:
        """Build and launch the step; its tokens into rec.emitted / rec.logprobs, or (overlapped) rec.pending.
        samplers: the step's sampling sequences (the chain plan's load)."""
        sched, conf = rec.sched, rec.conf
        runner = self.runner
        t_build = time.perf_counter()
        runner.kv.fence_tier_copies()  # a prefix hit's tier copies land before this step reads its blocks
        batch, sampling = runner.builder.build(sched, None)
        runner.plan_snapshots(sched)  # (V4 with prefix caching: the rings at the block boundaries it crosses)
        runner.reset_state_rows(batch)
        # decode rows through the decode graphs where they cover the step, else eagerly (spec/verify_batch.py)
        run = self.shapes.run_batch(batch, sched.scheduled, runner)
        t_forward = time.perf_counter()
        hidden = runner.run_model(run)
        t_plan = time.perf_counter()
        plan = self._plan_chain(rec, samplers)
        t_stage = time.perf_counter()
        self.policy_seconds += t_stage - t_plan
        items = sched.scheduled
        if plan is not None:  # the rooms and the pass's and chain's inputs, while the device runs the forward
            self.one_sync.stage(plan, items, self.scheduler.kv, self.scheduler.kv.max_model_len)
            runner.builder.sync_tables()  # the rooms' new blocks, in the device's tables before the chain reads them
        t_sample = time.perf_counter()
        emitted: list[list[int]] = [[] for _ in items]
        logprobs: list[list | None] = [None for _ in items]
        rec.emitted, rec.logprobs = emitted, logprobs
        grammar, self._failed = verify_masks(items, sampling, runner.grammar_facts, runner.grammar_forbidden)
        logits_indices = batch.logits_indices
        if self._failed:  # these sequences cannot be sampled: left out of the draw, failed in _process
            keep, r = [], 0
            for i in sampling:
                n = len(items[i].draft) + 1
                if i not in self._failed:
                    keep.extend(range(r, r + n))
                r += n
            grammar = grammar.select(keep) if grammar is not None else None
            logits_indices = logits_indices[tensor_to(keep, torch.int64, logits_indices.device)]
            sampling = [i for i in sampling if i not in self._failed]
        sample = None
        if sampling:  # a sequence whose rows the sampler cannot take fails alone (spec/verify_sampling.py)
            # a one-sync step's rows all sample, in order: its logits rows are hidden's rows (no gather)
            rows = hidden if plan is not None and not self._failed else hidden[logits_indices]
            logits = runner.model.compute_logits(rows).float()
            sample, sampling, failed = sample_isolated(runner.sampler, logits, verified_rows(items, sampling), items,
                                                       sampling, grammar)
            self._failed.update(failed)
        self._launch_parts = {"build": t_forward - t_build, "forward": t_plan - t_forward, "plan": t_stage - t_plan,
                              "stage": t_sample - t_stage, "sample": time.perf_counter() - t_sample}
        if plan is not None and sample is not None and not self._failed and len(sampling) == len(items):
            t0 = time.perf_counter()  # verification, pass and chain on the device; one read-back (spec/one_sync.py)
            self._one_sync_ran = True
            if self.overlap:  # the read-back is the next call's (spec/overlap.py)
                rec.pending, rec.plan, rec.sampling = self.one_sync.launch(plan, sample, hidden), plan, sampling
                rec.t_launched = time.perf_counter()
                rec.launch_s = rec.t_launched - t0
                return
            res = self.one_sync.finish(plan, sample, hidden, while_waiting=self._run_deferred)
            self._one_sync_done(rec, plan, sampling, res)
            self._draft_s = time.perf_counter() - t0  # (observed at the step's end, `_end`)
            return
        if sample is not None:
            self._run_deferred()  # (before the draw's read-back waits for the device)
            out = sample.output([t.cpu() for t in sample.tensors])
            self.num_host_reads += 1
            num_acc, toks, k = verify_on_host(items, sampling, out)
            self._emit(items, sampling, out, num_acc, toks, conf, emitted, logprobs, k)
        self._advance(sched, emitted)
        t_draft = time.perf_counter()
        self._draft_next(sched, hidden, emitted, batch)
        self._launch_parts["draft"] = time.perf_counter() - t_draft

    def _one_sync_done(self, rec: StepRecord, plan: OneSyncPlan, sampling: list[int], res: OneSyncResult) -> None:
        """A one-sync step's read-back on the host: its emitted tokens, num_computed_tokens, the next drafts."""
        items = rec.sched.scheduled
        self._emit(items, sampling, res.out, res.num_accepted, res.emitted, rec.conf, rec.emitted, rec.logprobs,
                   plan.k)
        self._advance(rec.sched, rec.emitted)
        self._book_one_sync(rec.sched, res)

    def _advance(self, sched: SchedulerOutput, emitted: list[list[int]]) -> None:
        """num_computed_tokens past the real and accepted tokens only (blocks are keyed in _process, after the
        rollback and once the emitted tokens are on the sequence)."""
        for item, toks in zip(sched.scheduled, emitted):
            accepted = max(len(toks) - 1, 0) if item.draft else 0
            item.seq.num_computed_tokens = item.context_len + item.num_tokens - len(item.draft) + accepted
