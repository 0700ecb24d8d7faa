"""`deepinfer generate [MODEL_PATH] PROMPT... [--prompt-file F] [--chat] [sampling flags]`.

Without a model directory (or --model) the embedded stdlib-coder model runs (see cli_args.resolve_model).

Generated text goes to stdout (or one JSON object per prompt with --json);
start-up lines and progress bars go to stderr, so the output can be piped.
"""

from __future__ import annotations

import argparse
import json
import sys

from deepinfer.entrypoints.cli_args import add_engine_args, engine_config_from_args, resolve_model

# flag dest -> SamplingParams field; only flags the user gave are passed on
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text for prompts offline",
        description="Generate completions for prompts given on the command line or in a file.",
    )
    add_engine_args(p)
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (several allowed)")
    p.add_argument("--prompt-file", default=None, help="file with one prompt per line ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="treat each prompt as a user message (chat template)")
    p.add_argument("--system", default=None, help="system message prepended in --chat mode")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (weight loading and generation)")
    s = p.add_argument_group("sampling")
    s.add_argument("--n", type=int, default=None, help="completions per prompt")
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--frequency-penalty", type=float, default=None)
    s.add_argument("--max-tokens", type=int, default=None)
    s.add_argument("--min-tokens", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=int, nargs="+", default=None)
    s.add_argument("--ignore-eos", action="store_true", default=None)
    s.add_argument("--logprobs", type=int, default=None, help="also return the top-N logprobs per token")
    s.add_argument("--request-seed", dest="request_seed", type=int, default=None, help="per-request sampling seed")
    p.set_defaults(run=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    from deepinfer.errors import InvalidRequestError

    prompts = list(args.prompts)
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            text = sys.stdin.read()
        else:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InvalidRequestError("no prompt given: pass PROMPT arguments or --prompt-file", param="prompt")
    return prompts


def sampling_params_from_args(args: argparse.Namespace):
    from deepinfer import SamplingParams

    kwargs = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name) is not None}
    if args.request_seed is not None:
        kwargs["seed"] = args.request_seed
    return SamplingParams(**kwargs)


def run(args: argparse.Namespace) -> int:
    from deepinfer import DeepInferenceEngine

    positional = list(args.prompts)
    resolve_model(args, positional)
    args.prompts = positional
    prompts = read_prompts(args)
    params = sampling_params_from_args(args)  # validate before loading the model
    config = engine_config_from_args(args, load_progress=not args.no_progress)
    engine = DeepInferenceEngine.from_config(config)
    print(f"deepinfer: loaded {engine.model_name} on backend {engine.backend_name}", file=sys.stderr)
    use_tqdm = not args.no_progress
    if args.chat:
        conversations = []
        for prompt in prompts:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            conversations.append(messages + [{"role": "user", "content": prompt}])
        outputs = engine.chat(conversations, params, use_tqdm=use_tqdm)
    else:
        outputs = engine.generate(prompts, params, use_tqdm=use_tqdm)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if args.json:
            print(json.dumps(_as_json(prompt, out), ensure_ascii=False))
        elif len(prompts) == 1 and len(out.outputs) == 1:
            print(out.text)
        else:
            for c in out.outputs:
                label = f"prompt {i}" + (f", sample {c.index}" if len(out.outputs) > 1 else "")
                print(f"--- {label}: {prompt!r} (finish: {c.finish_reason})")
                print(c.text)
    return 0


def _as_json(prompt: str, out) -> dict:
    return {
        "prompt": prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": None
                if c.logprobs is None
                else [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs],
            }
            for c in out.outputs
        ],
    }
