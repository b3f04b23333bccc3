"""The compiled CPU kernels against the torch paths they replace, printed side by side in one run
(docs/kernels.md, "The CPU path"):

(a) every base weight of the benchmark model once (the 16 layer matmuls and the LM head, as one
    rank at tp 1 holds them), for 1, 2, 4 and 8 rows (a decode step's), and for 16, 32 and 256
    (a prefill's): MKL's `F.linear` over the plain weight, oneDNN over its reordered copy, and the
    compiled kernel over its packed copy (up to 8 rows);
(b) the LoRA pass of a decode step: every module of the 4 layers, 8 rank-16 adapters in 8
    slots, one row each (and one row of one adapter): `torch_ops.add_fp32` against the compiled
    `add_lora_rows`.

Each pass runs after a 320-MiB write that evicts the weights from the caches, as a decode step
finds them; passes of the kinds alternate, so no kind runs in a quieter minute. Thread CPU time,
median of `--repeats` passes. One torch thread unless `--threads`.

Run: `. scripts/bootstrap.sh && python benchmarks/bench_cpu_kernels.py [--repeats N] [--threads N]`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import torch
import torch.nn.functional as F

from lorafleet_dev.synthetic import BENCHMARK_MODEL
from node_agent.engine.kernels import LoraBatch, cpu_kernels, dense, torch_ops

RANK, SLOTS = 16, 8


def base_shapes() -> list[tuple[int, int]]:
    """[out, in] of every dense weight of one rank at tp 1: qkv, o, gate_up, down per layer, the LM head."""
    s = BENCHMARK_MODEL
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    layer = [
        (qkv, s.hidden_size),
        (s.hidden_size, s.num_heads * s.head_dim),
        (2 * s.intermediate_size, s.hidden_size),
        (s.hidden_size, s.intermediate_size),
    ]
    return layer * s.num_layers + [(s.vocab_size, s.hidden_size)]


def lora_modules() -> list[tuple[int, list[int]]]:
    """(in, slice widths) of every LoRA module of the benchmark model's layers."""
    s = BENCHMARK_MODEL
    kv = s.num_kv_heads * s.head_dim
    layer = [
        (s.hidden_size, [s.num_heads * s.head_dim, kv, kv]),
        (s.num_heads * s.head_dim, [s.hidden_size]),
        (s.hidden_size, [s.intermediate_size, s.intermediate_size]),
        (s.intermediate_size, [s.hidden_size]),
    ]
    return layer * s.num_layers


def timed(evict: torch.Tensor, work: Callable[[], object]) -> float:
    evict.add_(1.0)
    start = time.thread_time()
    work()
    return time.thread_time() - start


def bench_base(repeats: int, evict: torch.Tensor, lib: ctypes.CDLL | None) -> None:
    weights = [torch.randn(n, k) / k**0.5 for n, k in base_shapes()]
    packed = [dense.pack(w) for w in weights]
    mb = sum(w.numel() for w in weights) * 4 / 2**20
    print(f"\n(a) every base weight once ({len(weights)} matmuls, {mb:.0f} MiB), median ms")
    print(f"{'rows':>6}{'MKL F.linear':>16}{'oneDNN copy':>16}{'compiled':>12}{'compiled / oneDNN':>20}{'/ MKL 1 row':>14}")
    one_row_mkl = None
    for rows in (1, 2, 4, 8, 16, 32, 256):
        xs = [torch.randn(rows, w.shape[1]) for w in weights]

        def mkl(xs: list[torch.Tensor] = xs) -> None:
            for x, w in zip(xs, weights, strict=True):
                F.linear(x, w)

        def onednn(xs: list[torch.Tensor] = xs) -> None:
            for x, p in zip(xs, packed, strict=True):
                assert p is not None and p.onednn is not None
                torch.ops.mkldnn._linear_pointwise(x, p.onednn, None, "none", [], "")

        def compiled(xs: list[torch.Tensor] = xs) -> None:
            for x, w, p in zip(xs, weights, packed, strict=True):
                assert lib is not None and p is not None and p.few_rows is not None
                cpu_kernels.gemm(lib, x, p.few_rows, w.shape[0])

        kinds = {"mkl": mkl, "onednn": onednn}
        if lib is not None and rows <= cpu_kernels.MAX_ROWS:
            kinds["compiled"] = compiled
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(repeats):
            for kind, work in kinds.items():
                times[kind].append(timed(evict, work))
        m = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
        one_row_mkl = one_row_mkl or m["mkl"]
        own = m.get("compiled")
        print(
            f"{rows:>6}{m['mkl']:>16.2f}{m['onednn']:>16.2f}"
            + (f"{own:>12.2f}{own / m['onednn']:>19.2f}x{own / one_row_mkl:>13.2f}x" if own is not None else f"{'-':>12}")
        )


@dataclass
class LoraModule:
    """One module's LoRA buffers in both forms, and a decode step's rows for it."""

    a_joined: torch.Tensor
    b_stacks: list[torch.Tensor]
    scales: torch.Tensor
    x: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    out: torch.Tensor = field(default_factory=lambda: torch.empty(0))


def bench_lora(repeats: int, evict: torch.Tensor, lib: ctypes.CDLL | None) -> None:
    modules = [
        LoraModule(
            torch.randn(SLOTS, RANK * len(widths), inp) / inp**0.5,
            [torch.randn(SLOTS, RANK, w).transpose(1, 2) / RANK**0.5 for w in widths],  # column-major, as the layers
            torch.rand(len(widths), SLOTS) + 0.5,
        )
        for inp, widths in lora_modules()
    ]
    buffers = [cpu_kernels.lora_buffers(m.a_joined, m.b_stacks, m.scales) for m in modules]
    views = [(tuple(m.a_joined.unbind(0)), tuple(zip(*(b.unbind(0) for b in m.b_stacks), strict=True))) for m in modules]
    mb = sum(m.a_joined.numel() + sum(b.numel() for b in m.b_stacks) for m in modules) * 4 / 2**20
    print(f"\n(b) a decode step's LoRA pass, {len(modules)} modules, rank {RANK}, {SLOTS} slots ({mb:.0f} MiB of A and B), median ms")
    print(f"{'rows':>6}{'torch add_fp32':>18}{'compiled':>12}{'ratio':>10}")
    for rows in (1, 8):
        batch = LoraBatch.from_token_slots(torch.arange(rows, dtype=torch.int32) % SLOTS)
        for m in modules:
            m.x, m.out = torch.randn(rows, m.a_joined.shape[2]), torch.zeros(rows, sum(b.shape[1] for b in m.b_stacks))

        def in_torch(batch: LoraBatch = batch) -> None:
            for m, (a_slots, b_slots) in zip(modules, views, strict=True):
                torch_ops.add_fp32(m.x, m.out, a_slots, b_slots, m.scales, batch)

        def compiled(batch: LoraBatch = batch) -> None:
            for m, prepared in zip(modules, buffers, strict=True):
                assert lib is not None and prepared is not None
                cpu_kernels.add_lora_rows(lib, m.x, m.out, prepared, batch.token_slots)

        kinds = {"torch": in_torch, **({"compiled": compiled} if lib is not None else {})}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(repeats):
            for kind, work in kinds.items():
                times[kind].append(timed(evict, work))
        med = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
        own = med.get("compiled")
        print(f"{rows:>6}{med['torch']:>18.2f}" + (f"{own:>12.2f}{own / med['torch']:>9.2f}x" if own is not None else f"{'-':>12}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="passes of each kind (default 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as one rank of a CPU engine at tp >= 2 here)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_kernels.library()
    print(
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.2f}; compiled kernels {'built' if lib is not None else 'UNAVAILABLE (see the log)'}"
    )
    evict = torch.zeros(320 << 18)  # 320 MiB of fp32
    with torch.inference_mode():
        bench_base(args.repeats, evict, lib)
        bench_lora(args.repeats, evict, lib)


if __name__ == "__main__":
    main()
