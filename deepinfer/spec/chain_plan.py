"""The adaptive policy's chain plan (spec/slot_policy.py's SlotPolicy inherits it): the modelled tokens per second
of plain decoding and of chains of 1..k at a load (`chain_rates`), and the choice among them, measured gains first
(`_choose_chain`, spec/realized_rates.py). Apart from slot_policy.py only to keep each file to one concern; it reads
the policy's own fields (k, calibrator, cost, step_times, realized, mean_confidence, decisions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.spec.step_times import PLAIN, SPECULATIVE

if TYPE_CHECKING:
    from deepinfer.spec.slot_policy import SlotPolicy


class ChainPlan:
    """Methods of SlotPolicy (self is one): the chain length a load drafts."""

    def _choose_chain(self: SlotPolicy, num_seqs: int) -> int:
        """The L in 1..k with the best tokens per second in steady state, or 0 where none beats plain decoding:
        each chain's gain over plain decoding is its realized one where it and plain decoding were measured at this
        load (spec/realized_rates.py; where plain decoding was not but two chains were, their measured ratio around
        the model's gain for the most-measured one, `_anchored`), else the model's (below, `chain_rates`) times the
        model's error at the nearest measured chain (measured gain / modelled gain there: the model's error is mostly one of scale, its step-time
        corrections, shared by neighbouring chains); where two drafting chains' step times are measured at one load, the
        model's shape is first fitted to them (`_fitted_rates`: its error in a link's cost, a slope, is one no scale
        fixes). So the measure decides what was measured, and the model's shape
        proposes another chain only where it beats the measure by more than the model's error (counted in
        decisions["overruled"] where the choice differs from the model's alone). A measure overrules the model's
        order only where it tells them apart: where the model's best chain is measured, the measured best chain's
        realized rate must be above it by at least measured_z standard errors of the two measures
        (RealizedRates.separation); else the plan is the model's shape scaled by its error at its best chain, which
        then drafts (decisions["within_noise"]). Why: a step's tokens vary with its acceptance
        (1 to k + 1 a sequence), so a few steps' rate is loose; on an H100 (2026-12-06, session 28, ec53dea) at one
        sequence chain 5 was measured over 5 steps at 2,740 tok/s against chain 3's 3,101 over 43, and the plan
        drafted chains of 3 and 4 where static k5 ran 2.36x of speculation off and k3 1.91x.

        A pause needs a clear loss (`_hold`): the best chain's gain below 1 / (1 + pause_margin), or below 1 / (1 +
        measured_pause_margin) where that chain's gain is a realized one against plain decoding measured at this load (a
        measure, not the model's guess: on this CPU at 64 sequences, 2026-12-05, the plan kept drafting chains of 1 at a
        realized 0.92x of plain decoding, inside the model's margin, and ran 0.87x of speculation off). Why the margin
        at all: on the H200 (2026-12-05, d14f347) a drafting step at 4 / 16 / 64 / 256 sequences emitted 1.6 / 1.8 / 1.7
        / 1.4x the tokens per second of a pause step (spec/step_phases.py), yet the first timed run at each load paused
        36-45 of its ~50 steps on plans that put plain decoding ahead (the model: 2x ahead at 256 sequences, where the
        realized rates had it 0.94x of a chain of 4), and each pause's end paid a catch-up pass and a probe on the host
        path (host-path steps of 31.5 ms on average at 64 sequences).

        The model (spec/slot_policy.py: SlotPolicy's docstring). Every sequence's slots share one survival (the
        calibrated estimate at the slot's mean confidence), so the admission of such a step verifies whole slot levels and a chain longer
        than what is verified only costs: the steady state of L is B sequences verifying L slots each, yielding
        B * (1 + S_1 + ... + S_L) tokens (S_j: the reach probability of slot j) in cost(B * (1 + L)) plus the
        drafting of chains of L, each side corrected by the measured step times at this load (`observe_step`,
        spec/step_times.py). Plain floats: this runs every replan_every steps while drafting steadily (and at every
        other plan). Reads calibration counts, past confidences, past step times and realized rates only.

        The measured rates are priced by paired tokens (RealizedRates.paired, on since session 39: each chain's tokens
        counted on the longest trusted chain's steps). With paired_model set ("current" / "longest"; off by
        default) the model's tokens are such counts too (`_paired_tokens`), so its shape, and the fill of a chain not
        measured, rest on what the drafts yielded at this load."""
        model_tokens, model_seconds = self.chain_model(num_seqs)
        model_tokens = self._paired_tokens(num_seqs, model_tokens)
        rates = [t / s for t, s in zip(model_tokens, model_seconds)]  # (chain_rates)
        modelled = [r / rates[0] for r in rates]
        floor = 1.0 / (1.0 + self.pause_margin)
        model = _hold(modelled, floor)
        self._plan_gain = max(modelled[1:], default=0.0)
        self._plan_gains = modelled  # (what a challenge compares chains by: spec/chain_challenge.py)
        self._plan_seconds = model_seconds  # (what bounds a shorter challenger's reach: spec/chain_challenge.py)
        measured = self.realized.gains(num_seqs, self.k)
        self._plan_measured = bool(measured)  # (against plain decoding: SlotPolicy._checks_pause)
        if not measured:
            measured = _anchored(modelled, self.realized.chains_at_one_load(num_seqs, self.k))
        if not measured:
            return self._vetoed(model, num_seqs, rates[0])
        mtop = _best(modelled)
        mbest = max(measured, key=lambda c: (measured[c], -c))
        if mtop in measured and mbest != mtop:
            z = self.realized.separation(num_seqs, mbest, mtop)
            if z is not None and z < self.measured_z:  # the measures do not tell the model's best from theirs:
                measured = {mtop: measured[mtop]}  # the model's shape, scaled by its error at its best chain
                self.decisions["within_noise"] = self.decisions.get("within_noise", 0) + 1
        # where two chains' step times are measured at one load, the model's times fitted to them give the shape
        # (also where their realized rates were just found within noise: those rates vary with each step's
        # acceptance, the fit's inputs are step times and the calibrated survival, steadier both)
        fitted = self._fitted_rates(num_seqs, (model_tokens, model_seconds))
        if fitted is not None:
            self.decisions["time_fit"] = self.decisions.get("time_fit", 0) + 1
        gains = list(modelled)
        shape = fitted if fitted is not None else rates
        if fitted is not None and self.fit_orders:  # the fit orders the chains, the most-measured one scales them
            steps = self.realized.steps_near(num_seqs)
            anchor = max(measured, key=lambda c: (steps.get(c, 0), -c))
            gains[1:] = [fitted[c] * measured[anchor] / fitted[anchor] for c in range(1, len(gains))]
        else:
            for chain in range(1, len(gains)):  # unmeasured: the shape's gain, scaled by its error at the nearest one
                near = min(measured, key=lambda m: (abs(m - chain), m))
                gains[chain] = measured[chain] if chain in measured else shape[chain] * measured[near] / shape[near]
        top = _best(gains)
        if self._plan_measured and top in measured:  # the best chain measured against plain decoding at this load
            floor = 1.0 / (1.0 + self.measured_pause_margin)
        best = _hold(gains, floor)
        self._plan_gain = gains[top] if top else 0.0
        self._plan_gains = gains
        if best != model:
            self.decisions["overruled"] = self.decisions.get("overruled", 0) + 1
        return self._vetoed(best, num_seqs, rates[0])

    def _paired_tokens(self: SlotPolicy, num_seqs: int, tokens: list[float]) -> list[float]:
        """The model's tokens a step at num_seqs sequences (index: chain, 0 plain), with chains 0..M taken from what
        they would have emitted on the steps of M (RealizedRates.paired_near, per sequence, times num_seqs): M the
        chain drafted now (paired_model "current") or the longest chain trusted at this load ("longest"); a chain
        past M the model's own past M's count: M's plus the model's tokens of the deeper slots. Unchanged where no
        such counts are, or paired_model is off (""). Why: the model's tokens are the calibrated
        survival at the drafts' mean confidence, an engine-life average over every load and slot; on H100s
        (2026-12-07, session 38) it put a chain of 5 at 4.0 tokens a step at one sequence (3.8 for 4) where chain 5's
        steps emitted ~5.5, so it priced shorter chains close to it, and challenges of them (8 steps of ~4 tokens
        against ~6) ran every cell. Why off by default: in benchmarks/spec_policy_sim.py (12 seeds, h200-b1 / b4 /
        b64) "longest" ran 0.937 / 0.973 / 0.984 of the best static with --batch-phase 40:0.5 against 0.990 / 0.970
        / 0.985 off (a chain of 5 measured in a batch's hard first steps priced every chain there, and once a
        shorter one drafted, chain 5 was not measured again), "current" 0.977 / 0.974 / 0.986; mean over no phase,
        20:0.6 and 40:0.5: 0.975 "longest", 0.979 "current", 0.980 off."""
        if self.paired_model not in ("current", "longest"):
            return tokens
        paired = self.realized.paired_near(num_seqs, self.chain if self.paired_model == "current" else None)
        if paired is None or paired[0] <= 0.0:
            return tokens
        per_seq = float(num_seqs) / paired[0]
        out = [t * per_seq for t in paired[: len(tokens)]]
        top = len(out) - 1
        out.extend(out[top] + tokens[c] - tokens[top] for c in range(len(out), len(tokens)))
        return out

    def _vetoed(self: SlotPolicy, chain: int, num_seqs: int, plain_rate: float) -> int:
        """The plan's chain, or where it pauses (0) with no gain measured against plain decoding at this load, the
        chain whose realized rate here is the highest at least (1 + pause_margin) x the model's plain rate
        (decisions["pause_vetoed"]). Why: a plan that pauses on the model's prices alone runs a pause check (7 plain
        steps, then a re-measure); on H100s (2026-12-06, session 28, calls 6 and 13) at 4 sequences the model
        priced a chain of 5 at 1.09-1.18x plain decoding where its realized rate there was ~1.8x the plain rate
        the model gives, dipped under the pause floor once a cell, and each check cost about a tenth of the cell.
        The model's plain rate is corrected by the plain steps seen (spec/step_times.py), so it stands for a plain
        measure where one steady plain step or none was taken."""
        if chain or self._plan_measured or plain_rate <= 0.0 or not self.realized.decides:
            return chain
        need, best, best_rate = (1.0 + self.pause_margin) * plain_rate, 0, 0.0
        for c in range(1, self.k + 1):
            rate = self.realized.rate(num_seqs, c)
            if rate is not None and rate >= need and rate > best_rate:
                best, best_rate = c, rate
        if best:
            self.decisions["pause_vetoed"] = self.decisions.get("pause_vetoed", 0) + 1
        return best

    def chain_rates(self: SlotPolicy, num_seqs: int) -> list[float]:
        """Expected tokens per second of plain decoding (index 0) and of chains of 1..k (`_choose_chain`'s model)
        at num_seqs sampling sequences. No side effect (benchmarks print it)."""
        tokens, seconds = self.chain_model(num_seqs)
        return [t / s for t, s in zip(tokens, seconds)]

    def chain_model(self: SlotPolicy, num_seqs: int) -> tuple[list[float], list[float]]:
        """The model's expected tokens and seconds a step of plain decoding (index 0) and of chains of 1..k at
        num_seqs sampling sequences (their quotient: `chain_rates`)."""
        k, b = self.k, float(num_seqs)
        conf = [self.mean_confidence[j] if j < len(self.mean_confidence) else 0.5 for j in range(k)]
        survival = [min(max(self.calibrator.survival(j, c), 0.0), 1.0) for j, c in enumerate(conf)]
        # each chain's reach: the product of the slots' survival at their mean confidence, or (recent_drafts) its
        # mean over the recent drafts (spec/recent_drafts.py: the first is biased where survival is not linear)
        sampled = self.recent_drafts.expected_reach(self.calibrator, k, survival) \
            if self.recent_drafts is not None else None
        times = self.step_times
        tokens, seconds = [b], [times.seconds(PLAIN, num_seqs, self.cost.at(b))]
        reach, expected = 1.0, b
        for chain in range(1, k + 1):
            reach = reach * survival[chain - 1] if sampled is None else sampled[chain - 1]
            expected += b * reach
            drafting = self.drafting_seconds(num_seqs, chain)
            tokens.append(expected)
            seconds.append(times.seconds(SPECULATIVE, num_seqs, self.cost.at(b * (1 + chain)) + drafting, drafting))
        return tokens, seconds

    def _fitted_rates(self: SlotPolicy, num_seqs: int,
                      model: tuple[list[float], list[float]] | None = None) -> list[float] | None:
        """The model's expected tokens a step over step times fitted to the measured ones, per chain (index 0: plain
        decoding, as modelled), at the load of num_seqs's bucket nearest to it where at least two drafting chains'
        steady steps are measured and fresh (RealizedRates.seconds_at_one_load); None where none is, or where the
        fit does not rise with the modelled time. The fit: measured seconds = a + b x modelled seconds, least
        squares over the measured chains, a chain's fitted time kept at or above a plain step's there (measured, else
        modelled and scaled by the shortest measured chain's measure over its model): a line through two long
        chains' times may reach below it at chain 1.

        Why. `_choose_chain` fills a chain not measured with the model's gain scaled by its error at the nearest
        measure: a scale only, right where the model's error is one of scale (its step-time corrections), wrong
        where it is one of slope. The MTP chain's links cost what the drafting table does not see (on the H200,
        2026-12-05, session 17, at 4 sequences a one-sync step of k5 ran 0.31 ms over k3's where the table priced
        the two more links at 0.15 ms), so the model prices long chains too cheaply, and scaled at a measured chain
        of 4 it puts 3 below 4 however fast 3 truly is: in benchmarks/spec_policy_sim.py's h200-b4 (links at twice
        their price) the plan measured chains 4 and 5 and never drafted 3, where static k3 ran 1.35x of off
        against k5's 1.19x. Two measured chains give the step time's slope in the chain length, and the model's
        tokens (the calibrated survival) what each length yields: a shorter chain's rate follows. A fill only
        proposes: a chain it puts first is drafted, measured, and then its measure decides. model: chain_model(num_seqs)
        where the caller has it (used where the measured load is num_seqs itself)."""
        got = self.realized.seconds_at_one_load(num_seqs, self.k) if self.time_fit else None
        if got is None:
            return None
        load, secs = got
        tokens, modelled = model if model is not None and load == num_seqs else self.chain_model(load)
        chains = [c for c in secs if c > 0]
        xs, ys = [modelled[c] for c in chains], [secs[c] for c in chains]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx <= 0.0:
            return None
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if slope <= 0.0:
            return None
        short = min(chains)  # no chain's step is shorter than a plain one: measured, else modelled on its scale there
        floor = secs.get(0, modelled[0] * secs[short] / modelled[short])
        rates = [tokens[0] / modelled[0]]
        for chain in range(1, len(tokens)):
            rates.append(tokens[chain] / max(my + slope * (modelled[chain] - mx), floor, 1e-9))
        return rates


def _anchored(modelled: list[float], chains: dict[int, tuple[float, int]]) -> dict[int, float]:
    """Gains over plain decoding for chains measured against each other at one load where plain decoding was not
    measured: the most-measured chain keeps the model's gain, the others its gain times their realized rate over
    its. So the measures order the measured chains, and the model only says how far they are from plain decoding.
    Why: on an H100 (2026-12-05, 2d6a785) the realized rates at 4 sequences had a chain of 3 at 8,946 tok/s and a
    chain of 5 at 6,524, no plain step there, and the plan (the model's alone without a plain measure) ran chains
    of 5 for 41 steps where static k = 3 ran 1.42x of off against k = 5's 1.36x."""
    if len(chains) < 2:
        return {}
    anchor = max(chains, key=lambda c: (chains[c][1], -c))
    base = chains[anchor][0]
    return {c: modelled[anchor] * rate / base for c, (rate, _) in chains.items()}


def _best(gains: list[float]) -> int:
    """The chain 1..k with the best gain (ties: the shorter), 0 where there is none."""
    return max(range(1, len(gains)), key=lambda c: (gains[c], -c), default=0)


def _hold(gains: list[float], floor: float) -> int:
    """The chain with the best gain over plain decoding (ties: shorter), or 0 (a pause) only where that gain is
    below `floor`: a pause costs more than its plain steps (the MTP catch-up of its rows, a probe and a re-measure
    at its end), so a chain about as fast as plain decoding keeps drafting."""
    best = _best(gains)
    return best if best and gains[best] > floor * (1 + 1e-9) else 0
