"""Engine flags shared by `generate` and `serve`, mapped onto EngineConfig in one place.

Every flag defaults to None and only flags the user gave are passed on, so
EngineConfig's defaults and its DEEPINFER_* environment variables apply
otherwise (a flag wins over the environment).
"""

from __future__ import annotations

import argparse

# flag dest -> EngineConfig field (same name unless noted)
ENGINE_FIELDS = (
    "device",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "enforce_eager",
    "quantization",
    "seed",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory_bytes",
    "enable_chunked_prefill",
    "max_waiting_requests",  # serve only
    "async_scheduling",
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_PATH", help="local Hugging Face checkpoint directory")
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
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="fraction of device memory to use")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="never capture graphs")
    g.add_argument("--quantization", default=None, help="weight quantization scheme (default: from the checkpoint)")
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
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the next step's scheduling with the device (default: on for accelerators)")


def engine_config_from_args(args: argparse.Namespace):
    """EngineConfig from the parsed flags (only those given)."""
    from deepinfer.config import EngineConfig

    kwargs = {name: getattr(args, name) for name in ENGINE_FIELDS if getattr(args, name, None) is not None}
    return EngineConfig(model_name_or_path=args.model, **kwargs)
