#!/usr/bin/env python3
"""GPU benchmark of paged-decode attention: the triton kernel vs the torch path, in GB/s.

Shapes are an 8B-class model's attention on one rank (32 query heads, 8 KV heads, head_dim 128,
bf16), pages of 16 tokens in shuffled blocks, 1–256 sequences with contexts of 128–8192 tokens.
Decode reads every context token's K and V once, so its least traffic is the K/V of the
contexts plus q and the output; the table shows the triton time, that traffic, the achieved
GB/s and its fraction of the device's peak, the torch path's time, and the largest difference
between the two. L2 is flushed before every timed call (disable with --no-flush).

Needs a CUDA GPU; `--help` works anywhere. Run from the repository root:

    python benchmarks/bench_paged_attention_gpu.py [--peak-gbps 4800] [--seqs 1 16 64] ...
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

if importlib.util.find_spec("node_agent") is None:  # run as a script from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels_gpu import FLUSH_BYTES, time_ms  # this script's own directory is on sys.path

from node_agent.engine.kernels import paged_attention, paged_attention_triton


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="peak memory bandwidth, GB/s (H200: 4800)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--max-tokens", type=int, default=1 << 20, help="skip cases with more context tokens in all")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-torch", action="store_true", help="skip timing the torch path")
    parser.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    return parser.parse_args(argv)


def run_case(seqs: int, context: int, args: argparse.Namespace, flush: torch.Tensor | None) -> str:
    """One row of the table: `seqs` sequences of `context` tokens each, in shuffled pages."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    pages_per_seq = -(-context // args.page_size)
    num_blocks = seqs * pages_per_seq
    shape = (num_blocks, args.page_size, args.kv_heads, args.head_dim)
    key = torch.randn(shape, device=device, generator=gen).to(dtype)
    value = torch.randn(shape, device=device, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, device=device, generator=gen).reshape(seqs, pages_per_seq).to(torch.int32)
    lengths = torch.full((seqs,), context, dtype=torch.int32, device=device)
    q = torch.randn(seqs, args.heads, args.head_dim, device=device, generator=gen).to(dtype)
    scale = args.head_dim**-0.5
    cache = paged_attention.PagedLayer(key, value, tables)

    def triton_fn() -> object:
        return paged_attention_triton.decode(q, cache, lengths, scale)

    def torch_fn() -> object:
        return paged_attention.decode_torch(q, cache, lengths, scale)

    error = (triton_fn().float() - torch_fn().float()).abs().max().item()
    element = key.element_size()
    moved = 2 * seqs * context * args.kv_heads * args.head_dim * element + 2 * q.numel() * element
    triton_ms = time_ms(triton_fn, args.warmup, args.iters, flush)
    torch_ms = None if args.no_torch else time_ms(torch_fn, args.warmup, args.iters, flush)
    gbps = moved / (triton_ms * 1e-3) / 1e9
    torch_us = "-" if torch_ms is None else f"{torch_ms * 1e3:.1f}"
    return (
        f"{seqs:>6}{context:>9}{moved / 1e6:>10.2f}{triton_ms * 1e3:>11.1f}{gbps:>9.0f}"
        f"{100 * gbps / args.peak_gbps:>7.1f}%{torch_us:>11}{error:>10.1e}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_paged_attention_gpu: needs a CUDA GPU and none is visible; nothing was measured.", file=sys.stderr)
        return 2
    flush = None if args.no_flush else torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    print(
        f"device: {torch.cuda.get_device_name()}  peak: {args.peak_gbps:.0f} GB/s  bf16  heads {args.heads}/"
        f"{args.kv_heads}  head_dim {args.head_dim}  page {args.page_size}  L2 flush: {not args.no_flush}"
    )
    header = f"{'seqs':>6}{'context':>9}{'MB':>10}{'triton us':>11}{'GB/s':>9}{'% peak':>8}{'torch us':>11}{'max|err|':>10}"
    print(header)
    print("-" * len(header))
    for seqs in args.seqs:
        for context in args.contexts:
            if seqs * context <= args.max_tokens:
                print(run_case(seqs, context, args, flush))
    return 0


if __name__ == "__main__":
    sys.exit(main())
