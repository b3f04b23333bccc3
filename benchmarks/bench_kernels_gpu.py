#!/usr/bin/env python3
"""GPU benchmark of the multi-LoRA shrink/expand kernels: triton vs the torch path.

Shapes are one layer of an 8B-class model (hidden 4096; Llama-3-8B qkv under GQA: q 4096,
k 1024, v 1024; a single 4096-wide slice for o_proj-like layers), ranks 16 and 64, 1–64
adapters in a batch, decode (one token per sequence) and prefill (long segments).

For each case the table shows the triton time, the bytes it must move at least (activations,
the A/B rows of the adapters actually in the batch, the output; expand reads and writes
`out`), the achieved GB/s and its fraction of the device's peak memory bandwidth, and the time
of the torch path with the speed-up. L2 is flushed before every timed call (disable with
--no-flush) so small cases measure HBM, not cache.

Needs a CUDA GPU; `--help` works anywhere. Run from the repository root:

    python benchmarks/bench_kernels_gpu.py [--peak-gbps 4800] [--ranks 16 64] ...
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if importlib.util.find_spec("node_agent") is None:  # run as a script from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.engine.kernels import torch_ops, triton_ops
from node_agent.engine.kernels.batch import LoraBatch

SLICE_SETS = {"qkv": (4096, 1024, 1024), "single": (4096,)}
FLUSH_BYTES = 512 * 1024 * 1024  # larger than any current GPU's L2


@dataclass(frozen=True)
class Case:
    op: str  # shrink | expand
    phase: str  # decode | prefill
    slices: str  # key of SLICE_SETS
    rank: int
    adapters: int
    tokens: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="peak memory bandwidth, GB/s (H200: 4800)")
    parser.add_argument("--hidden", type=int, default=4096, help="input features of shrink")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16, 64], help="distinct adapters in a batch")
    parser.add_argument("--decode-tokens", type=int, default=64, help="sequences in a decode batch (1 token each)")
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="tokens in a prefill batch")
    parser.add_argument("--slices", nargs="+", choices=sorted(SLICE_SETS), default=["qkv", "single"])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-torch", action="store_true", help="skip timing the torch path (slow for many adapters)")
    parser.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    return parser.parse_args(argv)


def grouped_slots(tokens: int, adapters: int, device: torch.device) -> torch.Tensor:
    """Tokens split into `adapters` contiguous groups, one segment per adapter (slot = index).

    Decode with 64 sequences and 64 adapters is one token per segment; prefill is long segments.
    """
    owner = torch.arange(tokens, device=device) * adapters // tokens
    return owner.to(torch.int32)


def time_ms(fn: Callable[[], object], warmup: int, iters: int, flush: torch.Tensor | None) -> float:
    """Mean time of `fn` in ms from CUDA events around each call, L2 flushed outside them."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends, strict=True):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sum(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / iters


def run_case(
    case: Case, args: argparse.Namespace, dtype: torch.dtype, flush: torch.Tensor | None, device: torch.device
) -> dict[str, object]:
    """Check triton against torch once, then time both; the row of the table as a dict."""
    widths = SLICE_SETS[case.slices]
    hidden, rank, slots = args.hidden, case.rank, max(args.adapters)
    gen = torch.Generator(device=device).manual_seed(0)
    batch = LoraBatch.from_token_slots(grouped_slots(case.tokens, case.adapters, device))
    element = torch.tensor([], dtype=dtype).element_size()
    active = len(batch.active_slots)
    if case.op == "shrink":
        x = torch.randn(case.tokens, hidden, device=device, generator=gen).to(dtype)
        stacks = [(torch.randn(slots, rank, hidden, device=device, generator=gen) / hidden**0.5).to(dtype) for _ in widths]
        moved = x.numel() * element + active * len(widths) * rank * hidden * element + len(widths) * case.tokens * rank * 4

        def triton_fn() -> object:
            return triton_ops.shrink(x, stacks, batch)

        def torch_fn() -> object:
            return torch_ops.shrink(x, stacks, batch)

        error = (triton_fn() - torch_fn()).abs().max().item()
    else:
        y = torch.randn(len(widths), case.tokens, rank, device=device, generator=gen)
        stacks = [(torch.randn(slots, width, rank, device=device, generator=gen) / rank**0.5).to(dtype) for width in widths]
        scales = torch.full((len(widths), slots), 1e-3, device=device)
        out = torch.zeros(case.tokens, sum(widths), device=device, dtype=dtype)
        moved = y.numel() * 4 + active * sum(widths) * rank * element + 2 * out.numel() * element

        def triton_fn() -> object:
            triton_ops.expand(y, stacks, scales, batch, out)
            return None

        def torch_fn() -> object:
            torch_ops.expand(y, stacks, scales, batch, out)
            return None

        # Compare from a zero `out` in fp32, so the check does not depend on rounding history.
        got = torch.zeros(case.tokens, sum(widths), device=device)
        want = got.clone()
        triton_ops.expand(y, stacks, scales, batch, got)
        torch_ops.expand(y, stacks, scales, batch, want)
        error = (got - want).abs().max().item()
    triton_ms = time_ms(triton_fn, args.warmup, args.iters, flush)
    torch_ms = None if args.no_torch else time_ms(torch_fn, args.warmup, args.iters, flush)
    gbps = moved / (triton_ms * 1e-3) / 1e9
    return {
        "triton_us": triton_ms * 1e3,
        "gbps": gbps,
        "peak_frac": gbps / args.peak_gbps,
        "torch_us": None if torch_ms is None else torch_ms * 1e3,
        "speedup": None if torch_ms is None else torch_ms / triton_ms,
        "mbytes": moved / 1e6,
        "max_err": error,
    }


def cases(args: argparse.Namespace) -> list[Case]:
    found = []
    for op in ("shrink", "expand"):
        for phase, tokens in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
            for slices in args.slices:
                for rank in args.ranks:
                    for adapters in args.adapters:
                        if adapters <= tokens:
                            found.append(Case(op, phase, slices, rank, adapters, tokens))
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels_gpu: needs a CUDA GPU and none is visible; nothing was measured.", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    flush = None if args.no_flush else torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    print(
        f"device: {torch.cuda.get_device_name()}  peak: {args.peak_gbps:.0f} GB/s  dtype: {args.dtype}  "
        f"hidden: {args.hidden}  L2 flush: {not args.no_flush}"
    )
    header = (
        f"{'op':<7}{'phase':<8}{'slices':<7}{'rank':>5}{'adapt':>6}{'tokens':>7}{'MB':>9}"
        f"{'triton us':>11}{'GB/s':>9}{'% peak':>8}{'torch us':>11}{'speedup':>9}{'max|err|':>10}"
    )
    print(header)
    print("-" * len(header))
    for case in cases(args):
        row = run_case(case, args, dtype, flush, torch.device("cuda"))
        torch_us = "-" if row["torch_us"] is None else f"{row['torch_us']:.1f}"
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.1f}x"
        print(
            f"{case.op:<7}{case.phase:<8}{case.slices:<7}{case.rank:>5}{case.adapters:>6}{case.tokens:>7}"
            f"{row['mbytes']:>9.2f}{row['triton_us']:>11.1f}{row['gbps']:>9.0f}{100 * row['peak_frac']:>7.1f}%"
            f"{torch_us:>11}{speedup:>9}{row['max_err']:>10.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
