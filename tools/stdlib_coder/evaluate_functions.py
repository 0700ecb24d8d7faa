"""Does stdlib-coder write code that parses? Greedy completions of 100 held-out stdlib functions, via DeepInfer.

Each prompt is a held-out function's `def` line(s) plus its docstring (dedented to column 0, decorators
left out), ending at the docstring's closing quotes: not at a newline, because the BPE merges a newline
with the next line's indentation, so a prompt ending in a bare newline token tells the model the next
line starts at column 0 (the body is over). DeepInfer completes it greedily (temperature 0, at most `--max-tokens` tokens). The body is cut
where it ends: at the first non-blank line back at column 0, at EOS, or, when the token budget runs out
first, after the last complete line. The function counts as parsed when `ast.parse` accepts prompt + body
AND the body adds at least one statement after the docstring (a docstring alone is valid Python, so an
empty completion must not count).

The 100 functions are drawn with a fixed seed from every function in the held-out files that has a
docstring and at least one statement after it, whose source parses on its own once dedented, and whose
prompt is at most 384 tokens.

    python -m tools.stdlib_coder.evaluate_functions --out /tmp/functions.json
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import textwrap
from dataclasses import dataclass

from tools.stdlib_coder.corpus import split, stdlib_files

MAX_PROMPT_TOKENS = 384


@dataclass(frozen=True)
class FunctionCase:
    path: str
    name: str
    prompt: str  # def line(s) + docstring, ending at the docstring's closing quotes (no newline)


def _cases_in(path: str, text: str) -> list[FunctionCase]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        if len(node.body) < 2:
            continue
        whole = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno]))
        prompt = textwrap.dedent("".join(lines[node.lineno - 1: node.body[0].end_lineno]))
        if not whole.startswith(("def ", "async def ")) or not prompt.startswith(whole[:4]):
            continue
        try:
            ast.parse(whole)
        except SyntaxError:
            continue
        if not whole.startswith(prompt):
            continue  # dedent differed between the two (a docstring line less indented than the body)
        out.append(FunctionCase(path, node.name, prompt.rstrip("\n")))
    return out


def held_out_cases(tokenizer, n: int = 100, seed: int = 0) -> list[FunctionCase]:
    _, held = split(stdlib_files())
    cases = [c for f in held for c in _cases_in(f.rel_path, f.text)]
    cases = [c for c in cases if len(tokenizer.encode(c.prompt)) <= MAX_PROMPT_TOKENS]
    cases.sort(key=lambda c: (c.path, c.name, c.prompt))
    random.Random(seed).shuffle(cases)
    return cases[:n]


def cut_body(completion: str, finished_by_length: bool) -> str:
    """The completion up to where the function body ends (see the module docstring)."""
    kept = []
    for line in completion.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            return "".join(kept)  # back at column 0: the body is over
        kept.append(line)
    if finished_by_length and kept and not kept[-1].endswith("\n"):
        kept.pop()  # the budget ran out mid-line: keep complete lines only
    return "".join(kept)


def body_adds_statement(prompt: str, body: str) -> bool:
    try:
        fn = ast.parse(prompt + body).body[0]
    except (SyntaxError, IndexError):
        return False
    return isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(fn.body) >= 2


def evaluate(model: str | None, n: int, max_tokens: int, seed: int) -> dict:
    from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

    cfg = EngineConfig(model, load_progress=False) if model else EngineConfig(load_progress=False)
    engine = DeepInferenceEngine(cfg)
    cases = held_out_cases(engine.tokenizer, n, seed)
    outs = engine.generate([c.prompt for c in cases], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                           use_tqdm=False)
    rows = []
    for case, out in zip(cases, outs):
        comp = out.outputs[0]
        body = cut_body(comp.text, comp.finish_reason == "length")
        ok = body_adds_statement(case.prompt, body)
        rows.append({"path": case.path, "function": case.name, "parsed": ok, "body_lines": body.count("\n"),
                     "finish_reason": comp.finish_reason, "completion": body})
    parsed = sum(r["parsed"] for r in rows)
    return {"model": engine.model_name, "functions": len(rows), "parsed": parsed, "parse_rate": parsed / len(rows),
            "max_tokens": max_tokens, "seed": seed, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = evaluate(args.model, args.n, args.max_tokens, args.seed)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
