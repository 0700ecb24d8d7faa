"""`deepinfer make-checkpoint --preset NAME OUT [--seed S]` and `--list`.

Writes a random-weight Hugging Face checkpoint (config.json, safetensors,
tokenizer) for tests and benchmarks; no model hub is involved.
"""

from __future__ import annotations

import argparse
import os


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "make-checkpoint",
        help="write a random-weight checkpoint from a preset",
        description="Write a random-weight Hugging Face checkpoint with a working tokenizer.",
    )
    p.add_argument("out", nargs="?", metavar="OUT", help="output directory")
    p.add_argument("--preset", default=None, help="preset name (see --list)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--workers", type=int, default=1, help="processes writing shards at once (default 1)")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.set_defaults(run=run, parser=p)


def run(args: argparse.Namespace) -> int:
    from deepinfer.checkpoints import PRESETS, make_checkpoint
    from deepinfer.errors import ConfigError

    if args.list:
        width = max((len(n) for n in PRESETS), default=0)
        for name in sorted(PRESETS):
            print(f"{name:<{width}}  {PRESETS[name].description}")
        return 0
    if args.preset is None or args.out is None:
        args.parser.error("--preset NAME and OUT are required (or --list)")
    if args.preset not in PRESETS:
        raise ConfigError(f"unknown preset {args.preset!r}; available: {', '.join(sorted(PRESETS))}")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise ConfigError(f"output {args.out!r} already exists and is not an empty directory")
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    make_checkpoint(args.preset, args.out, seed=args.seed, workers=args.workers)
    print(f"wrote {args.preset} checkpoint to {args.out}")
    return 0
