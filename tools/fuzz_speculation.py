"""Speculation on vs off over random request mixes and engine settings (cpu, fp32): a developer's fuzz, not CI.

Why. The speculative path (spec/) promises that greedy and seeded requests give the same tokens, finish reasons and
text as speculation off (docs/speculative.md, "Guarantees"), under chunked prefill, preemption, prefix caching,
stop strings and tokens, min_tokens, penalties, logprobs, n > 1 and structured output, and with
`batch_invariant=True` bitwise the same logprobs too. The unit tests check each of those on chosen cases; this tool
draws many combinations of them, so a change to the verification, rollback or drafting code can be checked against
interactions nobody wrote a test for.

Each case draws engine settings (max_num_seqs, max_model_len, a token budget that chunks prompts, a KV pool small
enough to preempt, prefix caching on or off, the engine seed), a speculation setting (MTP or n-gram drafts, k 1..5,
static or adaptive) and 1-7 requests (greedy or seeded at T 0.5-1.2 with top-p / top-k; random max_tokens; stop
strings, stop token ids, min_tokens, repetition / presence / frequency penalties, logprobs, n = 2; on the embedded
model also choice / regex / JSON-schema / JSON-object structured output), runs them on an engine without speculation
and one with it, and compares every completion. Modes:
- `embedded`: the embedded trained model (its MTP drafts are mostly right: accepted and rejected runs);
- `v4`: a random tiny-v4 checkpoint (deepinfer.checkpoints.make_checkpoint), prompts of repeated id units (V4's
  sliding-window and compressor rollback; its random MTP drafts are nearly always rejected, n-gram's sometimes kept);
- `inv`: the embedded model with `batch_invariant=True`, greedy, logprob values compared exactly;
- `v4-trained`: a trained V4 checkpoint given with `--model` (tools/stdlib_coder/train_v4.py: the embedded model's
  tokenizer, so the embedded mode's code prompts and structured requests): V4's rollback under drafts that are
  accepted about half the time, where the random tiny-v4's are almost never.

    python -m tools.fuzz_speculation --mode embedded --first 0 --cases 100
Exit status 1 when any case mismatched or raised (each printed with its settings and requests).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

import deepinfer
from benchmarks.speculative import PROMPTS as BENCH_PROMPTS
from deepinfer import EngineConfig, SamplingParams
from deepinfer.engine import DeepInferenceEngine
from deepinfer.sampling_params import StructuredOutputsParams

# the speculation benchmark's code prompts, and two that extend two of them (prefix-cache hits on a shared prefix)
PROMPTS = [*BENCH_PROMPTS, BENCH_PROMPTS[0] + "    if n < 2:\n", BENCH_PROMPTS[1] + "    out = []\n"]
STRUCTURED = [StructuredOutputsParams(choice=["return x", "pass", "yield y", "raise"]),
              StructuredOutputsParams(regex=r"[a-z_]{2,12}\(\w*\)"),
              StructuredOutputsParams(json={"type": "object", "required": ["name", "n"], "properties": {
                  "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}}),
              StructuredOutputsParams(json_object=True)]


def completions(engine: DeepInferenceEngine, prompts: list, params: list[SamplingParams], exact: bool) -> list:
    """Per request: each completion's token ids, finish reason, text and logprobs (the ids; with exact, their values)."""
    outs = engine.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.text,
              None if c.logprobs is None else [sorted((t, lp.logprob) if exact else t for t, lp in step.items())
                                                for step in c.logprobs]) for c in o.outputs] for o in outs]


def draw_params(rng: random.Random, mode: str) -> SamplingParams:
    kw: dict = {"max_tokens": rng.randint(1, 90 if mode == "v4" else 48), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5 or mode == "inv":
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 0.8, 1.2]), seed=rng.randrange(1000), top_p=rng.choice([1.0, 0.9]),
                  top_k=rng.choice([-1, 20]))
    if rng.random() < 0.3:
        kw.update(stop=[rng.choice(["\n\n", "return", ":", "    if", "("])], include_stop_str_in_output=rng.random() < 0.5)
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(200 if mode == "v4" else 4096)]
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, min(10, kw["max_tokens"]))
    if rng.random() < 0.2:
        kw["repetition_penalty"] = rng.choice([1.1, 1.3])
    if rng.random() < 0.15:
        kw.update(presence_penalty=0.5, frequency_penalty=0.3)
    if rng.random() < 0.25 or mode == "inv":
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.1 and kw.get("seed") is not None:
        kw["n"] = 2
    if mode != "v4" and rng.random() < 0.25:
        for name in ("stop", "stop_token_ids", "min_tokens"):
            kw.pop(name, None)
        kw.update(structured_outputs=rng.choice(STRUCTURED), ignore_eos=False, max_tokens=max(kw["max_tokens"], 30))
    return SamplingParams(**kw)


def draw_case(rng: random.Random, mode: str, path: str) -> tuple[dict, dict, list, list[SamplingParams]]:
    """(engine settings, speculation settings, prompts, their sampling params) of one case."""
    base = {"model_name_or_path": path, "device": "cpu", "dtype": "float32", "load_progress": False, "block_size": 16,
            "max_num_seqs": rng.choice([2, 3, 4, 8]), "max_model_len": rng.choice([96, 160]),
            "max_num_batched_tokens": rng.choice([None, 24, 40, 64]), "num_kv_blocks": rng.choice([None, 12, 16, 24]),
            "enable_prefix_caching": rng.choice([None, True, False]), "seed": rng.randrange(100),
            "batch_invariant": mode == "inv"}
    methods = ["mtp", "ngram", "ngram"] if mode == "v4" else ["mtp", "mtp", "ngram"]
    spec = {"speculative_method": rng.choice(methods), "num_speculative_tokens": rng.randint(1, 5),
            "speculative_adaptive": rng.random() < 0.4}
    n = rng.randint(1, 7)
    if mode == "v4":  # ids in repeated units (n-gram drafts find copies)
        prompts = []
        for _ in range(n):
            unit = [rng.randrange(3, 200) for _ in range(rng.randint(2, 6))]
            prompts.append((unit * rng.randint(2, 8))[: rng.randint(4, 60)])
    else:
        prompts = [rng.choice(PROMPTS) for _ in range(n)]
    return base, spec, prompts, [draw_params(rng, mode) for _ in range(n)]


def run(mode: str, first: int, cases: int, model: str | None = None) -> int:
    """Runs the cases; returns how many mismatched or raised."""
    if mode == "v4-trained":
        if model is None:
            raise SystemExit("--mode v4-trained needs --model (a trained V4 checkpoint: tools/stdlib_coder/train_v4.py)")
        path = model
    elif mode == "v4":
        from deepinfer.checkpoints import make_checkpoint

        path = tempfile.mkdtemp(prefix="fuzz-v4-")
        make_checkpoint("tiny-v4", path, seed=0)
    else:
        path = deepinfer.embedded_model_path()
    failures = accepted = drafted = 0
    for case in range(first, first + cases):
        base, spec, prompts, params = draw_case(random.Random(case), mode, path)
        t0 = time.monotonic()
        try:
            want = completions(DeepInferenceEngine.from_config(EngineConfig(**base)), prompts, params, mode == "inv")
            on = DeepInferenceEngine.from_config(EngineConfig(**base, **spec))
            got = completions(on, prompts, params, mode == "inv")
        except Exception as e:  # noqa: BLE001 - a case that raises is reported with its settings, the rest go on
            failures += 1
            print(f"case {case}: raised {type(e).__name__}: {e}\n  engine {base}\n  spec {spec}\n  params {params}",
                  flush=True)
            continue
        st = on.stats()
        accepted, drafted = accepted + st.spec_accepted_tokens, drafted + st.spec_drafted_tokens
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        print(f"case {case}: {'ok' if not bad else f'MISMATCH in requests {bad}'} ({time.monotonic() - t0:.1f} s, "
              f"{spec['speculative_method']} k={spec['num_speculative_tokens']}"
              f"{' adaptive' if spec['speculative_adaptive'] else ''}, accepted {st.spec_accepted_tokens} of "
              f"{st.spec_drafted_tokens} drafts)", flush=True)
        if bad:
            failures += 1
            print(f"  engine {base}\n  spec {spec}", flush=True)
            for i in bad:
                print(f"  request {i}: {params[i]}\n    off: {want[i]}\n    on:  {got[i]}", flush=True)
    print(f"{mode}: {cases - failures} of {cases} cases equal, {accepted} of {drafted} drafts accepted", flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["embedded", "v4", "inv", "v4-trained"], default="embedded")
    ap.add_argument("--model", default=None, help="the checkpoint of --mode v4-trained")
    ap.add_argument("--first", type=int, default=0, help="the first case's seed (cases are numbered by their seed)")
    ap.add_argument("--cases", type=int, default=50)
    args = ap.parse_args(argv)
    if args.model is not None and args.mode != "v4-trained":
        ap.error("--model is only for --mode v4-trained")
    return 1 if run(args.mode, args.first, args.cases, args.model) else 0


if __name__ == "__main__":
    sys.exit(main())
