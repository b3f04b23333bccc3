"""lorafleet's engine beside stock vLLM's CPU build, in one run, one table (docs/serving.md,
"Beside stock vLLM").

For each dtype (fp32, bf16) and thread count (1, 2), both engines serve the same model and 8
rank-16 adapters on all seven modules, from one process each, as a user of each engine's Python
API sees them: lorafleet's `Engine.submit` (a rank process, tokens read on a thread per request),
vLLM's offline `LLMEngine` stepped by hand in its own environment (`vllm_side.py`, in
`scripts/build-vllm.sh`'s set-up: its OpenMP threads bound to the cores, tcmalloc and Intel
OpenMP preloaded, ../shared/notes/vllm-cpu.md). The same workloads go to one engine then the
other, interleaved, `--repeats` times:

- single: one 48-token greedy request with an adapter, prompt 32: its time, its time to first
  token (TTFT) and its per-token decode (median inter-token time);
- throughput: 1, 8 and 32 concurrent mixed-adapter requests (8 adapters and base), tokens/s;
- decode step: 8 sequences decoding together, without adapters and with 8 distinct ones (the
  median inter-token time while all 8 decode), and their ratio (the 8-adapter cost).

Each cell is the best of the repeats, with the worst in brackets; `ratio` is lorafleet / vLLM
(below 1 is better for times, above 1 for throughput). `--shape 1b` runs the ~1B Llama shape
(bf16 only: its fp32 copies would not fit beside vLLM here); `--quick` fewer tokens and repeats.

Run: `. scripts/bootstrap.sh && python benchmarks/bench_vs_vllm.py [--shape 1b] [--quick]`.
CPU timings on a shared machine are noisy: read the ratios, and the spread.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_serving import Timing, concurrent
from shapes import SHAPES, parameters, write_model_as

from lorafleet_dev.synthetic import SyntheticModel, write_adapter
from lorafleet_dev.vllm_servers import vllm_python as installed_vllm_python
from node_agent.engine import Engine, EngineConfig, Topology

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = 8
PROMPT = 32
Request = tuple[list[int], str | None, int]  # tokens, adapter (None: base), tokens to generate
Runner = Callable[[list[Request]], list[Timing]]


@dataclass(frozen=True)
class Workloads:
    """Every workload of one repetition, by name (see the module's docstring)."""

    by_name: dict[str, list[Request]]

    @staticmethod
    def of(vocab: int, new_tokens: int) -> Workloads:
        def prompt(seed: int) -> list[int]:
            generator = torch.Generator().manual_seed(seed)
            return torch.randint(0, vocab, (PROMPT,), generator=generator).tolist()

        def mixed(n: int) -> list[Request]:  # adapters a0..a7 and base in turn
            return [(prompt(100 + i), None if i % (ADAPTERS + 1) == ADAPTERS else f"a{i % (ADAPTERS + 1)}", new_tokens) for i in range(n)]

        return Workloads(
            {
                "single": [(prompt(0), "a0", new_tokens)],
                "concurrent 1": mixed(1),
                "concurrent 8": mixed(8),
                "concurrent 32": mixed(32),
                "step, no adapter": [(prompt(200 + i), None, new_tokens) for i in range(ADAPTERS)],
                "step, 8 adapters": [(prompt(200 + i), f"a{i}", new_tokens) for i in range(ADAPTERS)],
            }
        )


def throughput(timings: list[Timing]) -> float:
    """Generated tokens per second, first submission to last token."""
    start, end = min(t.submitted for t in timings), max(t.token_times[-1] for t in timings)
    return sum(len(t.token_times) for t in timings) / (end - start)


def decode_gap(timings: list[Timing]) -> float:
    """Median inter-token time while every sequence decodes (after the last first token)."""
    start = max(t.token_times[0] for t in timings)
    return statistics.median(b - a for t in timings for a, b in zip(t.token_times, t.token_times[1:], strict=False) if a > start)


# metric name -> (workload, figure of its timings, unit, whether higher is better)
METRICS: dict[str, tuple[str, Callable[[list[Timing]], float], str, bool]] = {
    "single request": ("single", lambda t: (t[0].token_times[-1] - t[0].submitted) * 1e3, "ms", False),
    "time to first token": ("single", lambda t: t[0].ttft * 1e3, "ms", False),
    "per-token decode": ("single", lambda t: statistics.median(t[0].gaps) * 1e3, "ms", False),
    "throughput, 1 concurrent": ("concurrent 1", throughput, "tok/s", True),
    "throughput, 8 concurrent": ("concurrent 8", throughput, "tok/s", True),
    "throughput, 32 concurrent": ("concurrent 32", throughput, "tok/s", True),
    "8-seq decode step, no adapter": ("step, no adapter", lambda t: decode_gap(t) * 1e3, "ms", False),
    "8-seq decode step, 8 adapters": ("step, 8 adapters", lambda t: decode_gap(t) * 1e3, "ms", False),
}


def vllm_environment(threads: int) -> dict[str, str]:
    """vLLM's tuned CPU set-up: `threads` OpenMP threads bound to cores 0.., none reserved,
    tcmalloc and the environment's Intel OpenMP preloaded (where present)."""
    python = Path(vllm_python())
    preload = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), python.parents[1] / "lib" / "libiomp5.so"]
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "LD_PRELOAD": ":".join(str(p) for p in preload if p.exists()),
    }


def vllm_python() -> str:
    """The python of stock vLLM's environment; the run stops where it is not installed."""
    python = installed_vllm_python(ROOT)
    if python is None:
        sys.exit("stock vLLM is not installed: run scripts/build-vllm.sh first")
    return python


@contextmanager
def vllm_engine(model: Path, dtype: str, adapters: list[Path], threads: int, log: Path) -> Iterator[Runner]:
    """vLLM's engine in its own environment (`vllm_side.py`), answering workloads."""
    command = [vllm_python(), str(Path(__file__).with_name("vllm_side.py")), str(model), dtype, *map(str, adapters)]
    with log.open("a") as errors:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, env=vllm_environment(threads)
        )
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout

    def answer(prefix: str) -> str:
        for line in stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        sys.exit(f"vLLM exited before answering; its log: {log}")

    def run(requests: list[Request]) -> list[Timing]:
        stdin.write(json.dumps(requests) + "\n")
        stdin.flush()
        return [Timing(submitted, tuple(times)) for submitted, times in json.loads(answer("RESULT "))]

    try:
        answer("READY")
        yield run
    finally:
        stdin.close()
        process.wait(timeout=120)


@contextmanager
def lorafleet_engine(model: Path, dtype: str, adapters: list[Path], threads: int) -> Iterator[Runner]:
    config = EngineConfig(
        model_dir=model,
        topology=Topology(1, 1),
        max_lora_rank=16,
        max_loras_per_batch=ADAPTERS,
        kv_cache_bytes=256 << 20,
        max_num_seqs=64,
        cpu_threads=threads,
        dtype=dtype,
    )
    with Engine(config) as engine:
        for i, path in enumerate(adapters):
            engine.load_adapter(f"a{i}", path)

        def run(requests: list[Request]) -> list[Timing]:
            return concurrent(engine, [(tokens, adapter) for tokens, adapter, _ in requests], requests[0][2])

        yield run


Samples = dict[str, dict[str, list[float]]]  # engine -> metric -> one value per repetition


def measure(runners: dict[str, Runner], workloads: Workloads, repeats: int) -> Samples:
    """Every workload on each engine in turn, `repeats` times (after one warm-up of each)."""
    for runner in runners.values():
        for requests in workloads.by_name.values():
            runner(requests)
    samples: Samples = {name: {metric: [] for metric in METRICS} for name in runners}
    for _ in range(repeats):
        for workload, requests in workloads.by_name.items():
            for name, runner in runners.items():
                timings = runner(requests)
                for metric, (source, figure, _, _) in METRICS.items():
                    if source == workload:
                        samples[name][metric].append(figure(timings))
    return samples


def cell(values: list[float], higher_is_better: bool) -> tuple[float, str]:
    best, worst = (max(values), min(values)) if higher_is_better else (min(values), max(values))
    return best, f"{best:.1f} ({worst:.1f})"


def print_table(columns: dict[str, Samples]) -> None:
    """One row per metric, per configuration lorafleet | vLLM | ratio (flushed)."""
    header = f"{'':<32}" + "".join(f"{label:^44}" for label in columns)
    print(header)
    print(f"{'':<32}" + f"{'lorafleet':>18}{'vLLM':>18}{'ratio':>8}" * len(columns))
    for metric, (_, _, unit, higher) in METRICS.items():
        row = f"{metric + f' ({unit})':<32}"
        for samples in columns.values():
            ours, ours_text = cell(samples["lorafleet"][metric], higher)
            theirs, theirs_text = cell(samples["vLLM"][metric], higher)
            row += f"{ours_text:>18}{theirs_text:>18}{ours / theirs:>8.2f}"
        print(row)
    row = f"{'8-adapter cost (x no adapter)':<32}"
    for samples in columns.values():
        costs = [min(s["8-seq decode step, 8 adapters"]) / min(s["8-seq decode step, no adapter"]) for s in samples.values()]
        row += f"{costs[0]:>18.2f}{costs[1]:>18.2f}{costs[0] / costs[1]:>8.2f}"
    print(row, flush=True)


def write_files(root: Path, shape: SyntheticModel, dtype: torch.dtype) -> tuple[Path, list[Path]]:
    model = write_model_as(root / "model", shape, dtype)
    return model, [write_adapter(root / f"a{i}", shape, rank=16, seed=i) for i in range(ADAPTERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="benchmark")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], help="default: both (bf16 for 1b)")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, help="default 3 (--quick: 2)")
    parser.add_argument("--quick", action="store_true", help="16 tokens a request instead of 48, 2 repeats")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    shape = SHAPES[args.shape]
    dtypes = args.dtypes or (["bfloat16"] if args.shape == "1b" else ["float32", "bfloat16"])
    repeats = args.repeats or (2 if args.quick else 3)
    workloads = Workloads.of(shape.vocab_size, 16 if args.quick else 48)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"shape {args.shape} ({parameters(shape) / 1e9:.2f}B parameters); {ADAPTERS} rank-16 adapters; prompt {PROMPT}, "
        f"{16 if args.quick else 48} tokens a request; best (worst) of {repeats}"
    )
    columns: dict[str, Samples] = {}
    with tempfile.TemporaryDirectory(prefix="lorafleet-vs-vllm-") as tmp:
        for dtype in dtypes:
            model, adapters = write_files(Path(tmp) / dtype, shape, getattr(torch, dtype))
            for threads in args.threads:
                torch.set_num_threads(threads)
                with (
                    lorafleet_engine(model, dtype, adapters, threads) as ours,
                    vllm_engine(model, dtype, adapters, threads, Path(tmp) / "vllm.log") as theirs,
                ):
                    columns[f"{dtype}, {threads} thread{'s' if threads > 1 else ''}"] = measure(
                        {"lorafleet": ours, "vLLM": theirs}, workloads, repeats
                    )
                # The table so far after each configuration: a run cut short still shows what it measured.
                print(f"\n{dtype}, {threads} threads done ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f})")
                print_table(columns)


if __name__ == "__main__":
    main()
