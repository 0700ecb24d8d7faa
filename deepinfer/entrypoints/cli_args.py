"""Engine flags shared by `generate` and `serve`, mapped onto EngineConfig in one place.

Every flag defaults to None and only flags the user gave are passed on, so
EngineConfig's defaults and its DEEPINFER_* environment variables apply
otherwise (a flag wins over the environment).

Errors name the flag, not the field: the engine says `EngineConfig.<field>` where a setting is
wrong, and name_flags() rewrites that to the flag the user typed (cli.main does it for every
error it reports), so a setting has one name in each interface and no second validator.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Sequence

# flag dest -> EngineConfig field (same name unless noted)
ENGINE_FIELDS = (
    "device",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "context_parallel_size",
    "cp_min_prefill_tokens",
    "enable_eplb",
    "eplb_num_redundant_experts",
    "eplb_step_interval",
    "ep_dispatch",
    "ep_all_to_all_min_tokens",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "dist_timeout_s",
    "gpu_memory_utilization",
    "enforce_eager",
    "quantization",
    "quantization_config",
    "seed",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory_bytes",
    "enable_chunked_prefill",
    "max_waiting_requests",  # serve only
    "async_scheduling",
    "batch_invariant",
    "enable_prefix_caching",
    "kv_host_cache_gib",
    "kv_disk_cache_dir",
    "kv_disk_cache_gib",
    "kv_retention_hours",
    "kv_window_rollback_tokens",
    "kv_cache_dtype",
    "structured_output_backend",
    "speculative_method",
    "num_speculative_tokens",
    "speculative_adaptive",
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_PATH", nargs="?", default=None,
                        help="local Hugging Face checkpoint directory (default: the embedded stdlib-coder model)")
    parser.add_argument("--model", dest="model_flag", metavar="MODEL_PATH", default=None,
                        help="the checkpoint directory, as a flag (then every positional argument is a prompt)")
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--device",
        default=None,
        help="auto | cpu | cuda | npu | <backend name> (default: $DEEPINFER_DEVICE or auto); see `deepinfer backends`",
    )
    g.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "float32"], help="compute dtype")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="devices the attention heads, dense layers and vocabulary are split over (docs/parallelism.md)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="data-parallel replicas, each scheduling its own requests (world = tp x dp processes)")
    g.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="spread the routed experts (whole) over every rank instead of splitting each one over tp")
    g.add_argument("--context-parallel-size", "-cp", type=int, default=None,
                   help="ranks a long prefill's tokens are split over, each with the whole model "
                        "(context-parallel prefill; docs/parallelism.md)")
    g.add_argument("--cp-min-prefill-tokens", type=int, default=None,
                   help="prefill tokens of a step from which it is split over the context-parallel ranks "
                        "(default 1024)")
    g.add_argument("--enable-eplb", action="store_true", default=None,
                   help="the expert load balancer: count expert load, re-place experts between steps")
    g.add_argument("--eplb-num-redundant-experts", type=int, default=None,
                   help="extra copies of hot experts the balancer may place")
    g.add_argument("--eplb-step-interval", type=int, default=None, help="engine steps between re-balancings")
    g.add_argument("--ep-dispatch", default=None, choices=["auto", "all_to_all", "all_gather"],
                   help="how the expert-parallel MoE layers move tokens (default auto: all_gather below "
                        "--ep-all-to-all-min-tokens, all_to_all from there; docs/parallelism.md)")
    g.add_argument("--ep-all-to-all-min-tokens", type=int, default=None,
                   help="tokens per forward (over every replica) from which --ep-dispatch auto uses all_to_all "
                        "(default 256)")
    g.add_argument("--nnodes", type=int, default=None, help="nodes of the job (torchrun-compatible rendezvous)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank among --nnodes")
    g.add_argument("--master-addr", default=None, help="the rendezvous host (node 0)")
    g.add_argument("--master-port", type=int, default=None, help="the rendezvous port")
    g.add_argument("--dist-timeout-s", type=float, default=None,
                   help="longest a collective waits for a rank before every rank stops with an error")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="fraction of device memory to use")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="never capture graphs")
    g.add_argument("--quantization", default=None, help="weight quantization scheme (default: from the checkpoint)")
    g.add_argument("--quantization-config", default=None, metavar="QUANT.YAML",
                   help="quantization config file: method, weight_bits, activation_bits, ... (docs/quantization.md)")
    g.add_argument("--seed", type=int, default=None, help="engine seed for unseeded requests")
    g.add_argument("--block-size", type=int, default=None, help="KV cache block size in tokens")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per group (default: from memory)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="memory for the KV cache")
    g.add_argument(
        "--no-chunked-prefill",
        dest="enable_chunked_prefill",
        action="store_false",
        default=None,
        help="schedule each prompt's prefill in one step",
    )
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of cached prompt prefixes (default: on for V2 / V3, off for V4)")
    g.add_argument("--kv-host-cache-gib", type=float, default=None,
                   help="prefix cache host tier: GiB of host memory for blocks evicted from the device (default off)")
    g.add_argument("--kv-disk-cache-dir", default=None,
                   help="prefix cache disk tier: evicted KV blocks go to files here and survive restarts")
    g.add_argument("--kv-disk-cache-gib", type=float, default=None, help="size limit of the disk tier (default 10)")
    g.add_argument("--kv-retention-hours", type=float, default=None,
                   help="hours a disk-tier block is kept (default 72)")
    g.add_argument("--kv-window-rollback-tokens", type=int, default=None,
                   help="tokens a sliding-window KV group keeps behind its window for rollback (V4; default: 140 "
                        "with speculative decoding, else 0)")
    g.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto = the compute dtype; fp8 = the MLA latent cache in e4m3 with a "
                        "per-layer scale, half the memory (V2 / V3; docs/quantization.md)")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="bitwise the same tokens and logprobs whatever the batch (docs/determinism.md; "
                        "or DEEPINFER_BATCH_INVARIANT=1)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the next step's scheduling with the device (default: on for accelerators)")
    g.add_argument("--structured-output-backend", default=None, choices=["llguidance", "xgrammar"],
                   help="grammar engine of structured output (json schema / regex / grammar / choice; "
                        "default llguidance; docs/structured-output.md)")
    g.add_argument("--speculative-method", default=None, choices=["mtp", "ngram"],
                   help="speculative decoding: draft with the checkpoint's MTP module (mtp; or "
                        "DEEPINFER_ENABLE_MTP_VARLEN=1) or by prompt lookup (ngram); docs/speculative.md")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="most drafted tokens verified per step (default 5; or DEEPINFER_USE_NEXTN_DECODE=N)")
    g.add_argument("--speculative-adaptive", action="store_true", default=None,
                   help="the confidence scheduler picks each request's draft length per step")
    # read when an error is reported, not now: serve adds --max-waiting-requests after this
    parser.set_defaults(engine_flags=functools.partial(engine_flags, parser))


def resolve_model(args: argparse.Namespace, prompts: list[str] | None = None) -> str | None:
    """The model directory the command line names, or None for the embedded model.

    `--model` wins. Without it, the positional MODEL_PATH is the model; for `generate` (prompts given) it
    is the model only when it is a directory, and otherwise the first prompt, so that
    `deepinfer generate "def fib(n):"` runs the embedded model. A first argument that looks like a path
    (no spaces, a '/' in it) but is no directory is an error, never silently sent as a prompt."""
    from deepinfer.errors import ConfigError

    if args.model_flag is not None:
        if args.model is not None:
            if prompts is None:
                raise ConfigError(f"the model is given twice: MODEL_PATH {args.model!r} and --model {args.model_flag!r}")
            prompts.insert(0, args.model)
            args.model = None
        return args.model_flag
    if args.model is None or prompts is None or os.path.isdir(args.model):
        return args.model
    if "/" in args.model and not any(c.isspace() for c in args.model):
        from deepinfer.data import embedded_model_path

        raise ConfigError(f"MODEL_PATH {args.model!r} is not a directory (to send it as a prompt to the embedded "
                          f"model, name that model: --model {embedded_model_path()})")
    prompts.insert(0, args.model)
    args.model = None
    return None


def engine_config_from_args(args: argparse.Namespace, **overrides):
    """EngineConfig from the parsed flags (only those given), plus settings a subcommand derives from its
    own flags (generate's --no-progress -> load_progress=False). Call resolve_model first where prompts
    follow the model."""
    from deepinfer.config import EngineConfig

    kwargs = {name: getattr(args, name) for name in ENGINE_FIELDS if getattr(args, name, None) is not None}
    model = args.model_flag if args.model_flag is not None else args.model
    if args.model_flag is not None and args.model is not None:
        resolve_model(args)  # raises: the model given twice
    return EngineConfig(model_name_or_path=model, **kwargs, **overrides)


def engine_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    """EngineConfig field -> the option strings of the flag that sets it, as `parser` defines them."""
    return {a.dest: tuple(a.option_strings) for a in parser._actions if a.option_strings and a.dest in ENGINE_FIELDS}


_FIELD_REF = re.compile(r"\bEngineConfig\.([A-Za-z_]\w*)")


def name_flags(message: str, flags: dict[str, tuple[str, ...]], argv: Sequence[str]) -> str:
    """`message` with every `EngineConfig.<field>` that a flag sets replaced by that flag: the spelling
    the user typed (last one wins, as for the value: `-tp`, `--no-async-scheduling`), else its long name.
    Fields without a flag keep their EngineConfig name."""
    options_given = list(argv[: argv.index("--")] if "--" in argv else argv)

    def flag(match: re.Match) -> str:
        options = flags.get(match.group(1))
        if not options:
            return match.group(0)
        for token in reversed(options_given):
            for option in options:
                if token == option or token.startswith(option + "="):
                    return option
        return next((o for o in options if o.startswith("--")), options[0])

    return _FIELD_REF.sub(flag, message)


def user_message(exc: BaseException, args: argparse.Namespace | None, argv: Sequence[str]) -> str:
    """The text a CLI prints for an error: its message, in the flags' names where `args` has engine flags."""
    message = str(exc) or type(exc).__name__
    flags = getattr(args, "engine_flags", None)
    return name_flags(message, flags(), argv) if flags is not None else message
