"""The flags every command that starts an engine shares, and the `EngineConfig` they make.

`UsageError` is how every command reports bad command-line input: one line, exit code 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from node_agent.engine import EngineConfig, Topology


class UsageError(ValueError):
    """Bad command-line input (reported as one line, exit code 2)."""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts an engine."""
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory (config.json + *.safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks in the engine (default 1)")
    parser.add_argument("--dp", type=int, default=1, help="DP-attention groups; must divide --tp (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel groups for MoE models; must divide --tp (default 1)")
    parser.add_argument("--fully-sharded-loras", action="store_true", help="S-LoRA mode: shard LoRA A/B on the rank dim too")
    defaults = EngineConfig
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=defaults.max_lora_rank,
        help=f"largest adapter rank accepted (default {defaults.max_lora_rank})",
    )
    parser.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=defaults.max_loras_per_batch,
        help=f"device LoRA slots per rank (default {defaults.max_loras_per_batch})",
    )
    parser.add_argument(
        "--max-loaded-loras",
        type=int,
        default=defaults.max_loaded_loras,
        help=f"adapters kept loaded on the host (default {defaults.max_loaded_loras})",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=defaults.device, help=f"where ranks run (default {defaults.device}, gloo)"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="weights dtype (default: float32 on cpu, bfloat16 on cuda)"
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=0,
        help="the ranks' rendezvous port on 127.0.0.1, held by the agent while they run (default: one the kernel picks)",
    )
    parser.add_argument(
        "--engine-startup-timeout-s",
        type=float,
        default=EngineConfig.startup_timeout_s,
        metavar="S",
        help="how long the ranks may take to start and load the base model before the command fails "
        f"(default {EngineConfig.startup_timeout_s:g}; keep it under a pod's start-up probe)",
    )
    # Serving (docs/serving.md): the paged KV cache and the scheduler's limits.
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=EngineConfig.kv_cache_bytes,
        metavar="B",
        help=f"each rank's paged KV cache budget in bytes (default {EngineConfig.kv_cache_bytes >> 20} MiB)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="on cuda: size each rank's KV cache so the engine uses this fraction of the device's "
        "memory (what the model already holds comes off; replaces --kv-cache-bytes)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        metavar="N",
        help="torch threads of each cpu rank (default: the machine's cores / --tp; fewer on a busy machine)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        metavar="N",
        help=f"tokens per KV block (default {EngineConfig.block_size})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        metavar="S",
        help=f"sequences per step over all DP groups (default {EngineConfig.max_num_seqs})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        metavar="T",
        help=f"new tokens per step over all DP groups, at least --max-num-seqs (default {EngineConfig.max_num_batched_tokens})",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the KV of cached prompt prefixes (never across adapters or the base model)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags as an `EngineConfig`; a bad value is a usage error."""
    if not args.engine_startup_timeout_s > 0:
        raise UsageError("--engine-startup-timeout-s must be positive")
    return EngineConfig(
        model_dir=args.model,
        topology=Topology(tp_size=args.tp, dp_size=args.dp, ep_size=args.ep, fully_sharded_loras=args.fully_sharded_loras),
        max_lora_rank=args.max_lora_rank,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        device=args.device,
        dtype=args.dtype,
        master_port=args.master_port,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_threads=args.cpu_threads,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=args.enable_prefix_caching,
        startup_timeout_s=args.engine_startup_timeout_s,
    )
