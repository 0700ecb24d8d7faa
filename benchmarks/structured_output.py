"""Structured output: mask time p50 / p99 and compile time per grammar engine, and decode throughput of
structured vs unconstrained requests (docs/structured-output.md has the numbers).

    python benchmarks/structured_output.py [--engines llguidance xgrammar] [--batches 1 64 256]
        [--schemas 60] [--model PATH] [--json]

Schema set: generated here (seeded), objects mixing strings with maxLength / pattern, integer and
number bounds, enums, arrays with minItems / maxItems, nested objects, anyOf, additionalProperties
false: every keyword both engines enforce (pattern and maxLength never in one schema: XGrammar
refuses that). Mask time is measured along a real instance of each schema (the tokens of a valid
document, fed one by one; each fill timed), compile time is a cache miss of GrammarCompiler.
Throughput: the engine (CPU, fp32, embedded model unless --model) decodes B requests of exactly max_tokens
tokens; structured requests use LONG_RECORD (a string too long to finish, so EOS stays masked),
unconstrained ones ignore EOS; the two are alternated --reps times and the medians compared.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch


def make_schema(rng: random.Random, depth: int = 0) -> tuple[dict, dict]:
    """(schema, a valid instance of it)."""
    props, inst = {}, {}
    for i in range(rng.randint(2, 5)):
        name = f"f{i}"
        kind = rng.choice(["str", "pat", "int", "num", "enum", "arr", "obj" if depth < 2 else "int", "any"])
        if kind == "str":
            n = rng.randint(3, 12)
            props[name], inst[name] = {"type": "string", "maxLength": n}, "x" * rng.randint(0, n)
        elif kind == "pat":
            props[name], inst[name] = {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{2}$"}, "abc-12"
        elif kind == "int":
            lo = rng.randint(-100, 0)
            props[name], inst[name] = {"type": "integer", "minimum": lo, "maximum": lo + 500}, lo + 7
        elif kind == "num":
            props[name], inst[name] = {"type": "number", "exclusiveMinimum": 0}, 1.5
        elif kind == "enum":
            vals = [f"v{j}" for j in range(rng.randint(2, 6))]
            props[name], inst[name] = {"enum": vals}, vals[-1]
        elif kind == "arr":
            props[name] = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}
            inst[name] = [1, 22, 333][: rng.randint(1, 3)]
        elif kind == "obj":
            props[name], inst[name] = make_schema(rng, depth + 1)
        else:
            props[name] = {"anyOf": [{"type": "null"}, {"type": "boolean"}]}
            inst[name] = None
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return schema, inst


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def mask_and_compile(engine: str, schemas, tokenizer, facts) -> dict:
    from deepinfer import StructuredOutputsParams
    from deepinfer.sample.grammar.backend import bitmask_words
    from deepinfer.sample.grammar.compiler import GrammarCompiler

    compiler = GrammarCompiler(engine, facts, timeout_s=60.0, max_bytes=1 << 22)
    row = torch.empty(bitmask_words(facts.vocab_size), dtype=torch.int32)
    mask_us, compile_ms = [], []
    for schema, inst in schemas:
        t0 = time.perf_counter()
        compiled = compiler.compile(StructuredOutputsParams(json=schema, whitespace="compact"))
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        m = compiler.matcher(compiled)
        for tok in tokenizer.encode(json.dumps(inst, separators=(",", ":")), add_special_tokens=False):
            t0 = time.perf_counter()
            m.fill_bitmask(row)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            assert m.accept(tok), (engine, schema, inst)
    return {"engine": engine, "schemas": len(schemas), "masks": len(mask_us),
            "mask_us_p50": pct(mask_us, 0.5), "mask_us_p99": pct(mask_us, 0.99), "mask_us_max": max(mask_us),
            "compile_ms_p50": pct(compile_ms, 0.5), "compile_ms_p99": pct(compile_ms, 0.99),
            "compile_ms_max": max(compile_ms)}


# The throughput schema: a JSON object whose one string must be longer than max_tokens tokens can write, so the
# grammar cannot complete (EOS stays masked) and every structured request decodes exactly max_tokens tokens,
# the same as the unconstrained ones (which ignore EOS): equal work, and the masks are real JSON-string masks.
LONG_RECORD = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"],
               "additionalProperties": False}


def throughput(engine: str, batch: int, max_tokens: int, model: str | None, reps: int = 3) -> dict:
    """Decode tok/s, unconstrained and structured runs alternated `reps` times (the median of each is reported,
    with the spread), every request exactly max_tokens tokens (LONG_RECORD)."""
    from deepinfer import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model=model, device="cpu", dtype="float32", load_progress=False, max_num_seqs=max(batch, 1),
              max_model_len=256, structured_output_backend=engine, async_scheduling=True)
    prompts = [f"# record {i}\n" for i in range(batch)]
    result = {"engine": engine, "batch": batch, "max_tokens": max_tokens, "reps": reps}
    runs = {"unconstrained": SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=True),
            "structured": SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens,
                                         structured_outputs=StructuredOutputsParams(json=LONG_RECORD))}
    for p in runs.values():
        llm.generate(prompts[:2], p, use_tqdm=False)  # warm-up (compiles the grammar once)
    rates: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(reps):
        for label, p in runs.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, p, use_tqdm=False)
            dt = time.perf_counter() - t0
            lengths = {len(o.outputs[0].token_ids) for o in outs}
            if lengths != {max_tokens}:
                raise RuntimeError(f"{label}: outputs of {sorted(lengths)} tokens, expected {max_tokens} each")
            rates[label].append(batch * max_tokens / dt)
    for label, values in rates.items():
        result[f"{label}_tok_s"] = statistics.median(values)
        result[f"{label}_spread"] = [round(min(values), 1), round(max(values), 1)]
    result["ratio"] = result["structured_tok_s"] / result["unconstrained_tok_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", default=["llguidance", "xgrammar"])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 64, 256])
    ap.add_argument("--schemas", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=3, help="alternated unconstrained / structured runs per batch")
    ap.add_argument("--json", action="store_true", help="print one JSON object, no table")
    args = ap.parse_args()

    from deepinfer import embedded_model_path
    from deepinfer.sample.grammar.backend import TokenizerFacts
    from deepinfer.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(args.model or embedded_model_path())
    with open((args.model or embedded_model_path()) + "/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    facts = TokenizerFacts.from_tokenizer(tok, vocab, [tok.eos_token_id])
    rng = random.Random(0)
    schemas = [make_schema(rng) for _ in range(args.schemas)]
    report = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                         f"{torch.get_num_threads()} torch threads", "date": time.strftime("%Y-%m-%d"),
              "masks": [mask_and_compile(e, schemas, tok, facts) for e in args.engines],
              "throughput": [throughput(e, b, args.max_tokens, args.model, args.reps) for e in args.engines
                             for b in args.batches]}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"# {report['date']} {report['machine']}")
    print("engine      schemas masks  mask p50 us  mask p99 us  mask max us  compile p50 ms  compile p99 ms")
    for r in report["masks"]:
        print(f"{r['engine']:<11} {r['schemas']:>7} {r['masks']:>5} {r['mask_us_p50']:>12.1f} {r['mask_us_p99']:>12.1f} "
              f"{r['mask_us_max']:>12.1f} {r['compile_ms_p50']:>15.2f} {r['compile_ms_p99']:>15.2f}")
    print("engine      batch  unconstrained tok/s (spread)     structured tok/s (spread)  ratio")
    for r in report["throughput"]:
        print(f"{r['engine']:<11} {r['batch']:>5} {r['unconstrained_tok_s']:>10.1f} {str(r['unconstrained_spread']):>18} "
              f"{r['structured_tok_s']:>10.1f} {str(r['structured_spread']):>18} {r['ratio']:>6.2f}")


if __name__ == "__main__":
    main()
