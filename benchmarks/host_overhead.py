"""Host-side cost of one engine step (scheduler, batch building, sampler, output processing), on the CPU.

A real DeepInferenceEngine runs around a model whose forward and compute_logits return
preallocated tensors, so what is timed is the engine's own Python and torch host work: the
part that a CUDA graph replay cannot hide. The logits are V2-Lite sized (vocab 102400), so
the sampler does its real work (greedy: one argmax per row; sampled: the top-p sort and
Gumbel draw, which on a GPU would be device time, so it is reported apart). Prompts are random
ids, ignore_eos, fixed max_tokens: what benchmarks/throughput.py does. The tokenizer is the
tiny-v2-lite checkpoint's byte-level BPE, so detokenization is real too.

Per step we report the median over the first and the last `--window` decode steps, so work
that grows with output length shows up as late > early. Modes: greedy and sampled (temperature
0.8, top_p 0.95) over readable random tokens, and greedy-bytes, where every sequence repeats
tokens that decode to U+FFFD alone (stray UTF-8 bytes), as random-weight checkpoints often do:
that is the case where an incremental detokenizer that holds back text ending in U+FFFD
re-decodes an ever longer window.

Async scheduling (--async-scheduling off,on runs both): with it on, a step launches step N+1
and then processes step N's tokens. Here the fake forward returns at once and the CPU runs
every "device" op inside the host's call, so there is nothing to overlap: async vs sync shows
what the pipeline itself costs on the host (the pending-token bookkeeping, the device-side
input-id gather, the extra checks), and that it does not grow with output length. What it
cannot show is the overlap itself (a GPU step costs ~max(host, device) instead of the sum):
that needs a device, see benchmarks/throughput.py --async-scheduling on|off.

    python -m benchmarks.host_overhead --batch-sizes 1,64,256 --output-len 512
    python -m benchmarks.host_overhead --modes sampled --sampled-batch-sizes 1,64,256 --sampled-output-len 64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import tempfile
import time

import torch

from deepinfer.backend import BackendCaps, KVCacheSpec, KVLayout
from deepinfer.models.base import CausalLM

VOCAB = 102400  # DeepSeek-V2-Lite
# mode -> (sampling params, logits): "text" logits make readable random tokens; "bytes" logits
# make each sequence repeat tokens that decode to U+FFFD alone (stray UTF-8 bytes), which is
# what random-weight checkpoints like the benchmark's often emit.
MODES = {
    "greedy": (dict(temperature=0.0), "text"),
    "greedy-bytes": (dict(temperature=0.0), "bytes"),
    "sampled": (dict(temperature=0.8, top_p=0.95), "text"),
    "penalties": (dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5), "text"),
}


class HostBackend:
    """Caps and a device: all from_components needs."""

    name = "host-bench-cpu"

    def __init__(self, block_size: int):
        self.caps = BackendCaps(device_type="cpu", dtypes=(torch.float32,), kv_block_sizes=(block_size,))
        self.device = torch.device("cpu")

    def kv_cache_layout(self, spec: KVCacheSpec) -> KVLayout:
        return KVLayout.single(spec)


class ConstantLM(CausalLM):
    """forward / compute_logits return views of preallocated tensors: near-zero model cost.

    Logit rows rotate each call so a sequence gets a different token each step. Only ids
    below `text_vocab` (the tokenizer's) can win, so every token detokenizes.
    """

    model_type = "host-bench"
    quantization = None

    def __init__(self, max_tokens: int, max_rows: int, text_vocab: int, max_pos: int, byte_ids: list[int],
                 seed: int = 0):
        super().__init__(config={}, backend=None, dtype=torch.float32)
        self.vocab_size = VOCAB
        self.max_position_embeddings = max_pos
        g = torch.Generator().manual_seed(seed)
        self._hidden = torch.zeros(max_tokens, 1)
        self._rot = 61
        self._logits = torch.full((max_rows + self._rot, VOCAB), -30.0)
        self._logits[:, :text_vocab] = 4 * torch.rand(max_rows + self._rot, text_vocab, generator=g)
        self._logits[:, :8] = -30.0  # never draw the special tokens
        self._text_logits = self._logits
        self._byte_logits = torch.full((max_rows + self._rot, VOCAB), -30.0)
        rows = torch.arange(max_rows + self._rot)
        self._byte_logits[rows, torch.tensor(byte_ids)[rows % len(byte_ids)]] = 10.0
        self._calls = 0

    def use(self, logits: str) -> None:
        """Which logits the next steps return: "text" or "bytes"."""
        self._logits = self._text_logits if logits == "text" else self._byte_logits

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [KVCacheSpec("full", (0,), (1,), torch.float32)]

    def load_weights(self, weights) -> None:
        return None

    def finalize(self) -> None:
        return None

    def forward(self, batch, caches) -> torch.Tensor:
        return self._hidden[: batch.num_tokens]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._calls += 1
        k = self._calls % self._rot
        return self._logits[k : k + hidden.shape[0]]


class TimedSampler:
    """Wraps the engine's sampler to time it: on the CPU its vocab-wide kernels (argmax, top-p sort,
    Gumbel draw) are compute a GPU would do, so steps are also reported without it. The engine
    calls sample() (the device-side draw); last_s sums the calls since the last reset."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.last_s = 0.0

    def sample(self, logits, rows):
        s = time.perf_counter()
        out = self.sampler.sample(logits, rows)
        self.last_s += time.perf_counter() - s
        return out

    def __call__(self, logits, rows):
        s = time.perf_counter()
        out = self.sampler(logits, rows)
        self.last_s += time.perf_counter() - s
        return out


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def make_engine(tok_dir: str, max_batch: int, prompt_len: int, output_len: int, block_size: int,
                async_scheduling: bool = False):
    from deepinfer import EngineConfig
    from deepinfer.engine import DeepInferenceEngine
    from deepinfer.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tok_dir)
    max_len = prompt_len + output_len + 16
    budget = 16384  # throughput.py's --max-num-batched-tokens
    blocks = max_batch * -(-max_len // block_size) + 8
    text_vocab = min(int(tok.vocab_size), VOCAB)
    byte_ids = [i for i in range(8, text_vocab) if tok.decode([i]) == "\ufffd"][:16]
    model = ConstantLM(budget, max(max_batch, 1), text_vocab, max_len, byte_ids)
    cfg = EngineConfig(model_name_or_path="host-bench", max_num_seqs=max_batch, max_model_len=max_len,
                       max_num_batched_tokens=budget, num_kv_blocks=blocks, enforce_eager=True,
                       async_scheduling=async_scheduling)
    engine = DeepInferenceEngine.from_components(cfg, model, tok, HostBackend(block_size))
    engine.runner.sampler = TimedSampler(engine.runner.sampler)
    return engine


def run(engine, batch: int, prompt_len: int, output_len: int, mode: str, window: int, seed: int,
        profile_steps: int = 0) -> tuple[dict, str | None]:
    from deepinfer.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed + batch)
    sampling, logits = MODES[mode]
    engine.model.use(logits)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **sampling)
    ids = [f"{mode}{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(10, 1000, (prompt_len,), generator=g).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked by the token budget) until every request has a token
        for out in engine.step():
            started.add(out.request_id)
    times, sampler_times = [], []
    timed = engine.runner.sampler
    prof = cProfile.Profile() if profile_steps else None
    first_profiled = (output_len - profile_steps) // 2  # middle steps: outside the early / late windows
    while engine.has_unfinished_requests():
        profiling = prof is not None and first_profiled <= len(times) < first_profiled + profile_steps
        timed.last_s = 0.0
        s = time.perf_counter()
        if profiling:
            prof.enable()
        engine.step()
        if profiling:
            prof.disable()
        times.append(time.perf_counter() - s)
        sampler_times.append(timed.last_s)
    ms = [1e3 * t for t in times]
    rest = [1e3 * (t - st) for t, st in zip(times, sampler_times)]
    w = min(window, max(1, len(ms) // 2))
    res = {
        "bench": "host_overhead", "mode": mode, "async": engine.async_scheduling, "batch": batch,
        "prompt_len": prompt_len, "output_len": output_len,
        "decode_steps": len(ms),
        "early_ms": statistics.median(ms[:w]), "late_ms": statistics.median(ms[-w:]),
        "mean_ms": statistics.fmean(ms), "window": w,
        "sampler_early_ms": statistics.median(1e3 * t for t in sampler_times[:w]),
        "sampler_late_ms": statistics.median(1e3 * t for t in sampler_times[-w:]),
        "early_excl_sampler_ms": statistics.median(rest[:w]), "late_excl_sampler_ms": statistics.median(rest[-w:]),
    }
    res["late_over_early"] = res["late_ms"] / res["early_ms"]
    text = None
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        text = buf.getvalue()
    return res, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--modes", default="greedy,greedy-bytes,sampled", help=f"comma list of {sorted(MODES)}")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--sampled-batch-sizes", default="1,64",
                   help="batches for the sampled and penalties modes (vocab-wide sorts / counts are slow on a CPU)")
    p.add_argument("--sampled-output-len", type=int, default=128)
    p.add_argument("--window", type=int, default=32, help="steps in the early / late medians")
    p.add_argument("--block-size", type=int, default=64, help="the NVIDIA backend's default")
    p.add_argument("--profile-batch", type=int, default=256, help="cProfile middle steps at this batch (0: skip)")
    p.add_argument("--profile-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    p.add_argument("--async-scheduling", default="off,on", help="comma list of off / on: run each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {sorted(MODES)}")

    from deepinfer.checkpoints import make_checkpoint

    meta = {"bench": "host_overhead", "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "vocab": VOCAB, "block_size": args.block_size}
    print(json.dumps(meta), flush=True)
    results = []
    asyncs = []
    for a in args.async_scheduling.split(","):
        if a not in ("on", "off"):
            p.error(f"--async-scheduling takes on / off, got {a!r}")
        asyncs.append(a == "on")
    with tempfile.TemporaryDirectory() as tok_dir:
        make_checkpoint("tiny-v2-lite", tok_dir)
        for use_async in asyncs:
            engine = make_engine(tok_dir, max(batches), args.prompt_len, args.output_len, args.block_size, use_async)
            for mode in modes:
                sampled = mode in ("sampled", "penalties")
                out_len = args.sampled_output_len if sampled else args.output_len
                for b in ([int(x) for x in args.sampled_batch_sizes.split(",")] if sampled else batches):
                    prof_n = args.profile_steps if b == args.profile_batch else 0
                    res, prof = run(engine, b, args.prompt_len, out_len, mode, args.window, args.seed, prof_n)
                    print(json.dumps(res), flush=True)
                    results.append(res)
                    if prof:
                        print(f"cProfile, {mode}, batch {b}, async {use_async}, {prof_n} middle steps (by tottime):")
                        print("\n".join(prof.splitlines()[:40]), flush=True)
    print(f"\nms per engine.step(), prompt {args.prompt_len}; early / late = median of the first / last "
          f"{args.window} decode steps; 'w/o sampler' subtracts the time inside the sampler")
    print(f"{'mode':12} {'async':>5} {'batch':>5} {'out':>5} {'early':>8} {'late':>8} {'mean':>8} {'late/early':>10} "
          f"{'early w/o sampler':>18} {'late w/o sampler':>17}")
    for r in results:
        print(f"{r['mode']:12} {'on' if r['async'] else 'off':>5} {r['batch']:5d} {r['output_len']:5d} "
              f"{r['early_ms']:8.2f} {r['late_ms']:8.2f} "
              f"{r['mean_ms']:8.2f} {r['late_over_early']:10.2f} {r['early_excl_sampler_ms']:18.2f} "
              f"{r['late_excl_sampler_ms']:17.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
