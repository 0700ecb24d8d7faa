"""Host cost of a speculative engine step, on the CPU: what a GPU cannot hide while speculative engines run sync.

A real DeepInferenceEngine with MTP speculation runs around a stand-in model whose forward, logits, MTP forward and
MTP head are a few tiny torch ops (token t is followed by (7 t + 3) mod V; the MTP head drafts that, wrong after every
token divisible by 5 (one in four on its cycles), so drafts are partly accepted and rolled back), with the decode and MTP graphs of the contract over a
stand-in graph API whose replay re-runs the captured function. The time spent inside replays (the stand-in's
"device" work, which a GPU graph replays without the host) is measured and taken out: host = step wall - replays.
What remains is the engine's own Python and the eager torch ops it launches per step (sampler, verification,
index ops, copies: on a GPU, launches of ~5-10 us each).

Modes: off (no speculation; the decode graph replayed); k1, k3 with the one-sync step (spec/one_sync.py) and k3-host
(the same engine on the host path: DEEPINFER_SPEC_ONE_SYNC off). Per mode and concurrency: median step wall, replay
and host time (ms), tokens per step, the waits for the device per step (`SpecStepPipeline.host_reads`), and host
time per emitted token.

    python -m benchmarks.spec_host --concurrency 1 16 64 --max-tokens 64 [--phases]
    python -m benchmarks.spec_host --concurrency 1 --modes k5 adaptive-k5 --max-tokens 512 --interleave 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from deepinfer.backend import (
    BackendCaps,
    DecodeGraphRunner,
    KVCacheSpec,
    KVLayout,
    SingleProcessCommunicator,
    default_buckets,
)
from deepinfer.backend.native.decode_rows import decode_rows_meta as native_decode_rows_meta
from deepinfer.backend.native.draft_pick import draft_pick as native_draft_pick
from deepinfer.models.base import CausalLM
from deepinfer.spec.draft_cost import DraftCostTable
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.step_times import StepTimeRatios

VOCAB = 512


def _next(ids: torch.Tensor) -> torch.Tensor:
    return (7 * ids + 3) % VOCAB


class ChainLM(CausalLM):
    """next(t) = (7 t + 3) mod V, by one-hot logits; the MTP module drafts next(t), wrong where t % 5 == 0."""

    model_type = "deepseek_v3"
    quantization = None

    def __init__(self, max_pos: int):
        super().__init__(config=SimpleNamespace(hidden_size=1, num_hidden_layers=1), backend=None, dtype=torch.float32)
        self.vocab_size = VOCAB
        self.max_position_embeddings = max_pos
        self.mtp = [None]  # one MTP module (its math is mtp_forward / mtp_logits below)

    def kv_cache_specs(self, include_mtp: bool = False, kv_cache_dtype=None) -> list[KVCacheSpec]:
        return [KVCacheSpec("mla", (0, 1) if include_mtp else (0,), (1,), torch.float32)]

    def load_weights(self, weights) -> None:
        return None

    def finalize(self) -> None:
        return None

    def forward(self, batch, caches) -> torch.Tensor:
        return batch.input_ids.to(torch.float32).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = hidden[:, 0].long()
        logits = torch.zeros(ids.shape[0], VOCAB)
        return logits.scatter_(1, _next(ids).unsqueeze(1), 8.0)

    def mtp_forward(self, hidden, next_input_ids, batch, caches, k: int = 0) -> torch.Tensor:
        return next_input_ids.to(torch.float32).unsqueeze(1)

    wrong_drafts = False  # every draft wrong (an adaptive engine then pauses: its plain steps' host cost)

    def mtp_logits(self, state: torch.Tensor, k: int = 0) -> torch.Tensor:
        ids = state[:, 0].long()
        wrong = ids >= 0 if self.wrong_drafts else ids % 5 == 0
        draft = torch.where(wrong, (_next(ids) + 1) % VOCAB, _next(ids))
        return torch.zeros(ids.shape[0], VOCAB).scatter_(1, draft.unsqueeze(1), 8.0)


@dataclass
class TimedRunner(DecodeGraphRunner):
    """The contract's decode-graph runner over a stand-in graph API: a replay re-runs the captured function into its
    output buffer; `replay_s` sums the time spent in replays (the MTP graphs replay through it too)."""

    replay_s: float = 0.0

    def new_pool(self):
        return None

    def capture_one(self, fn, pool):
        out = fn()
        return {"fn": fn, "out": out}, out

    def replay(self, graph):
        t = time.perf_counter()
        graph["out"].copy_(graph["fn"]())
        self.replay_s += time.perf_counter() - t


class GraphHostBackend:
    """Caps (graphs on), a device, layouts and the stand-in graph runner: what from_components and speculation need."""

    name = "spec-host-bench"

    def __init__(self, block_size: int):
        self.caps = BackendCaps(device_type="cpu", dtypes=(torch.float32,), kv_block_sizes=(block_size,),
                                graph_capture=True)
        self.device = torch.device("cpu")

    def synchronize(self) -> None:  # the adaptive engine's cost profiling times with it; nothing is in flight here
        return None

    def communicator(self, group: str = "tp"):  # one process: the adaptive policy's times need no agreeing
        return SingleProcessCommunicator()

    def kv_cache_layout(self, spec: KVCacheSpec) -> KVLayout:
        return KVLayout.single(spec)

    def decode_rows_meta(self, *args) -> None:  # the MTP graphs' decode rows' inputs: the contract's torch op
        native_decode_rows_meta(*args)

    def draft_pick(self, *args) -> None:  # the MTP drafter's drafts and confidences: the contract's torch op
        native_draft_pick(*args)

    def make_graph_runner(self, model, caches, block_size, max_model_len, max_num_seqs):
        return TimedRunner.capture(model, caches, block_size, max_model_len, max_num_seqs, self.device,
                                   buckets=default_buckets(max_num_seqs))


MODES = {
    "off": {},
    "off-async": dict(async_scheduling=True),  # what a GPU engine without speculation runs
    "k1": dict(speculative_method="mtp", num_speculative_tokens=1),
    "k3": dict(speculative_method="mtp", num_speculative_tokens=3),
    "k3-host": dict(speculative_method="mtp", num_speculative_tokens=3),
    "k5": dict(speculative_method="mtp", num_speculative_tokens=5),
    # adaptive with the stand-in's partly right drafts, deciding by H200-like tables (`h200_like_tables`): the slot
    # policy's admission, plan and calibration every step
    "adaptive": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    # adaptive with every draft wrong: it pauses, so its steps are plain steps with the speculative engine's host
    # work around them (async pauses where DEEPINFER_SPEC_ASYNC_PAUSES=1)
    # adaptive whose drafting table prices a chain of 5 as one of 1 (`h200_like_tables(flat_chain=True)`), so that
    # its plan holds chains of 5 as static k5 drafts: the settled steady state, step for step like k5's, whose
    # extra host work is the adaptive mode's bookkeeping alone (on the GPU's host at 16 sequences, session 39:
    # +0.15 ms a step over k5's, all of the mode's 7% deficit there)
    "adaptive-k5": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
    "adaptive-paused": dict(speculative_method="mtp", num_speculative_tokens=5, speculative_adaptive=True),
}


class PricedStepTimes(StepTimeRatios):
    """Step-time corrections that take every step at its table price (ratio 1), with the bookkeeping's host cost
    kept: the stand-in's replays are host work that a GPU's steps are not, so measured, they would price drafting
    out (the adaptive mode here would pause) and its planning would not be timed."""

    def observe(self, kind: str, num_seqs: int, seconds: float, predicted: float, drafting: float = 0.0) -> None:
        super().observe(kind, num_seqs, predicted, predicted, drafting)


def h200_like_tables(policy, flat_chain: bool = False) -> None:
    """Give an adaptive engine's policy step and drafting prices of the H200's shape (a forward ~0.45 ms, nearly
    flat in its tokens; a chain of 5 ~0.2 ms), decide by them (no measuring plans, realized rates recorded but not
    deciding), so that it drafts as it would on the GPU and its admission, plan and bookkeeping run every step.
    flat_chain: a chain of k priced as one of 1 (its plan then drafts chains of k, as static k does)."""
    policy.cost = StepCostTable([1, 64, 4096], [0.45e-3, 0.5e-3, 4e-3])
    one = StepCostTable([1, 256], [0.06e-3, 0.3e-3])
    policy.draft_cost = DraftCostTable(policy.k, one, StepCostTable([1, 256], [0.06e-3, 0.3e-3] if flat_chain
                                                                     else [0.2e-3, 1.0e-3]))
    policy.step_times = PricedStepTimes()
    policy.measure_steps = 0
    policy.realized.decides = False


def make_engine(tok_dir: str, mode: str, max_seqs: int, max_tokens: int):
    from deepinfer import EngineConfig
    from deepinfer.engine import DeepInferenceEngine
    from deepinfer.text.tokenizer import Tokenizer

    max_len = max_tokens + 64
    cfg = EngineConfig(model_name_or_path="spec-host-bench", max_num_seqs=max_seqs, max_model_len=max_len,
                       num_kv_blocks=max_seqs * (max_len // 16 + 2) + 8, load_progress=False, **MODES[mode])
    model = ChainLM(max_len)
    model.wrong_drafts = mode == "adaptive-paused"
    engine = DeepInferenceEngine.from_components(cfg, model, Tokenizer.from_pretrained(tok_dir),
                                                 GraphHostBackend(16))
    if mode == "k3-host":
        engine._spec.one_sync = None
    if mode in ("adaptive", "adaptive-k5"):
        h200_like_tables(engine._spec.policy, flat_chain=mode == "adaptive-k5")
    return engine


def run_cell(engine, concurrency: int, max_tokens: int) -> dict:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", [10 + i, 20 + i, 30 + i, 40 + i], params)
    runner = engine.runner.graph_runner
    spec = engine._spec
    walls, replays, reads = [], [], []
    engine.step()  # the prompts' step
    p0 = (spec.policy_seconds, spec.policy_steps) if spec else (0.0, 0)
    phases0 = spec.phases.snapshot() if spec else None
    # tokens counted once, after the loop (no EngineStats between the timed steps: until 2026-12-05 a read ran the
    # speculative pipeline's deferred bookkeeping there, outside the steps that run it while they wait for the device)
    g0 = engine.stats().generation_tokens_total
    while engine.has_unfinished_requests():
        r0, h0 = runner.replay_s, spec.host_reads() if spec else 0
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
        replays.append(runner.replay_s - r0)
        reads.append((spec.host_reads() if spec else 1) - h0)
    tokens = engine.stats().generation_tokens_total - g0
    wall, rep = statistics.median(walls), statistics.median(replays)
    hosts = [w - r for w, r in zip(walls, replays)]
    return {"steps": len(walls), "wall_ms": 1e3 * wall, "replay_ms": 1e3 * rep,
            "host_ms": 1e3 * statistics.median(hosts), "tokens_per_step": tokens / max(len(walls), 1),
            "reads_per_step": sum(reads) / max(len(reads), 1),
            "policy_us": 1e6 * (spec.policy_seconds - p0[0]) / max(spec.policy_steps - p0[1], 1) if spec else 0.0,
            "host_ms_per_token": 1e3 * sum(hosts) / max(tokens, 1),
            "phases": spec.phases.since(phases0).describe() if spec else ""}


def interleaved(tok_dir: str, conc: int, modes: list[str], max_tokens: int, rounds: int) -> dict[str, dict]:
    """Per mode, the median over `rounds` cells of each phase's us a step (spec/step_phases.py), of the step kind most
    of its cell's steps ran as: the modes' engines built and warmed together, their cells run round-robin, so that
    a busy moment of this machine falls on every mode alike. Whole-step times here move with the stand-in's replays
    and this VM's load by more than a mode's own bookkeeping (tens of us a step, both ways, between two runs of the
    same engines); the phases that are each mode's own host work (slots, plan, deferred, observe) do not."""
    engines = {m: make_engine(tok_dir, m, max(conc, 1), max_tokens) for m in modes}
    for engine in engines.values():
        run_cell(engine, conc, 8)  # warm-up
    got: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    for _ in range(rounds):
        for m, engine in engines.items():
            before = engine._spec.phases.snapshot()
            run_cell(engine, conc, max_tokens)
            per = engine._spec.phases.since(before).per_step_ms()
            kind = max(per, key=lambda k: per[k]["steps"])
            for name, ms in per[kind].items():
                if name not in ("steps", "tokens"):
                    got[m].setdefault(name, []).append(1e3 * ms)
    return {m: {name: statistics.median(v) for name, v in rows.items()} for m, rows in got.items()}


def print_interleaved(conc: int, medians: dict[str, dict[str, float]]) -> None:
    """One row a phase: each mode's median us a step, then each later mode's difference from the first mode's."""
    modes = list(medians)
    base = modes[0]
    names = [n for n in medians[base] if all(n in medians[m] for m in modes)]
    print(f"{'conc':>5} {'phase us/step':>14} " + " ".join(f"{m:>12}" for m in modes)
          + "".join(f" {m + ' - ' + base:>24}" for m in modes[1:]))
    for name in names:
        print(f"{conc:>5} {name:>14} " + " ".join(f"{medians[m][name]:>12.2f}" for m in modes)
              + "".join(f" {medians[m][name] - medians[base][name]:>24.2f}" for m in modes[1:]), flush=True)


def main() -> None:
    from deepinfer.checkpoints.tokenizer_factory import write_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="cells per mode; the one with the least host time is kept")
    ap.add_argument("--phases", action="store_true",
                    help="print the kept cell's ms a step by phase and kind (spec/step_phases.py; replays included)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="instead: every mode's engine at once, ROUNDS cells each run round-robin, the median us a "
                         "step of each phase and each mode's difference from the first mode's (`interleaved`)")
    args = ap.parse_args()
    if args.interleave and any(m.startswith("off") for m in args.modes):
        ap.error("--interleave: modes without speculation have no step phases (use k1, k3, k5 or adaptive*)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tok_dir:
        write_tokenizer(tok_dir, VOCAB)
        if args.interleave:
            for conc in args.concurrency:
                print_interleaved(conc, interleaved(tok_dir, conc, args.modes, args.max_tokens, args.interleave))
            return
        print(f"{'conc':>5} {'mode':>8} {'steps':>6} {'wall ms':>8} {'replay ms':>9} {'host ms':>8} {'tok/step':>8} "
              f"{'reads/step':>10} {'host ms/tok':>11} {'policy us':>9}")
        for conc in args.concurrency:
            for mode in args.modes:
                engine = make_engine(tok_dir, mode, max(conc, 1), args.max_tokens)
                run_cell(engine, conc, 8)  # warm-up
                best = min((run_cell(engine, conc, args.max_tokens) for _ in range(args.repeats)),
                           key=lambda r: r["host_ms_per_token"])
                print(f"{conc:>5} {mode:>8} {best['steps']:>6} {best['wall_ms']:>8.3f} {best['replay_ms']:>9.3f} "
                      f"{best['host_ms']:>8.3f} {best['tokens_per_step']:>8.2f} {best['reads_per_step']:>10.2f} "
                      f"{best['host_ms_per_token']:>11.4f} {best['policy_us']:>9.0f}", flush=True)
                if args.phases and best["phases"]:
                    print(f"      phases: {best['phases']}", flush=True)
                if mode.startswith("adaptive"):
                    print(f"      adaptive plan decisions: {engine._spec.policy.decisions}", flush=True)


if __name__ == "__main__":
    main()
