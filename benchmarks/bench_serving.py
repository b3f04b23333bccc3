"""Serving benchmarks, printed side by side from one run on the benchmark model (hidden
1024, 4 layers, GQA 16/4, rank-16 adapters on all seven modules; fp32 on the CPU, bf16 on CUDA),
or with `--shape 1b` a ~1B-parameter Llama shape (benchmarks/shapes.py; its files in the dtype
served, bf16 unless `--dtype` says otherwise):

(1) one 48-token greedy Generate with an adapter (`Engine.submit`, tp=1) vs `transformers` +
    `peft` `generate` on the same model and adapter in this process; and the engine's per-token
    decode time vs the weight-streaming floor measured in the same run (one matrix-vector product
    over every weight matrix, LM head included);
(2) throughput (generated tokens/s) of 1, 8 and 32 concurrent mixed-adapter Generates;
(3) a decode step of 8 sequences with 8 distinct adapters vs the same 8 sequences with none
    (the median inter-token time while all 8 decode);
(4) time to first token and inter-token latency p50/p99 under a steady open-loop (Poisson)
    load of mixed-adapter requests at a fixed fraction of the throughput measured in (2).

Run: `. scripts/bootstrap.sh && python benchmarks/bench_serving.py [--threads N] [--device cuda] [--shape 1b]`.
The side by side with stock vLLM is `bench_vs_vllm.py`.
CPU timings on a shared machine are noisy: read the ratios of figures measured side by side.
Beside each wall-clock ratio of (1)-(3) the CPU-time ratio is printed too: the CPU seconds of
this process (transformers, the engine's driver) and of the engine's rank processes, from
/proc (Linux). Other load on the machine takes cores away but barely changes CPU time, so on a
busy machine those ratios are the ones to read (they cannot show time lost waiting for a core).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from shapes import SHAPES, write_model_as

from lorafleet_dev.synthetic import write_adapter
from node_agent.engine import Engine, EngineConfig, Topology
from node_agent.engine.serving.sampler import SamplingParams

PROMPT_VOCAB = min(shape.vocab_size for shape in SHAPES.values())  # prompts valid in every shape
RANK = 16
NEW_TOKENS = 48
PROMPT = 32
ADAPTERS = 8


def cpu_seconds() -> float:
    """CPU seconds used so far by this process (every thread) and its live child processes
    (the engine's ranks; clock-tick resolution)."""
    total = time.process_time()
    for child in multiprocessing.active_children():
        if child.pid is not None:
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


@dataclass(frozen=True)
class Timing:
    """One generation as its caller saw it: when it was submitted, and when each token came."""

    submitted: float
    token_times: tuple[float, ...]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def prompt(seed: int, length: int = PROMPT) -> list[int]:
    """A deterministic prompt of `length` token ids."""
    rng = random.Random(seed)
    return [rng.randrange(PROMPT_VOCAB) for _ in range(length)]


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def generate_one(engine: Engine, tokens: list[int], adapter: str | None, max_tokens: int) -> Timing:
    """Submit one greedy request and time its tokens as they arrive (a blocking read: with no
    `cancelled` check nothing needs polling; a poll only adds wake-ups to the driver's CPU)."""
    submitted = time.perf_counter()
    generation = engine.submit(tokens, adapter, SamplingParams(max_tokens=max_tokens))
    times = [time.perf_counter() for _ in generation.tokens()]
    return Timing(submitted, tuple(times))


def concurrent(engine: Engine, requests: list[tuple[list[int], str | None]], max_tokens: int) -> list[Timing]:
    """Submit every request at once; each is read on its own thread, as gRPC streams are."""
    results: list[Timing | None] = [None] * len(requests)

    def run(i: int, tokens: list[int], adapter: str | None) -> None:
        results[i] = generate_one(engine, tokens, adapter, max_tokens)

    threads = [threading.Thread(target=run, args=(i, t, a)) for i, (t, a) in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None]


@dataclass(frozen=True)
class Place:
    """Where the benchmark runs: the engine's device and dtype, and transformers' too."""

    device: str
    dtype: torch.dtype

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def weight_floor(model_dir: Path, place: Place, repeats: int) -> tuple[float, float]:
    """Seconds of one matrix-vector product over every weight matrix of the model (the least a
    decode step can take: it must stream every weight once): wall-clock and CPU medians."""
    from safetensors.torch import load_file

    weights = [w.to(place.device, place.dtype) for w in load_file(str(model_dir / "model.safetensors")).values() if w.dim() == 2]
    vectors = [torch.randn(w.shape[1], device=place.device, dtype=place.dtype) for w in weights]

    def once() -> tuple[float, float]:
        place.sync()
        start, cpu = time.perf_counter(), time.process_time()
        for w, x in zip(weights, vectors, strict=True):
            torch.mv(w, x)
        place.sync()
        return time.perf_counter() - start, time.process_time() - cpu

    once()
    runs = [once() for _ in range(repeats * 5)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def hf_generate(model_dir: Path, adapter: Path, tokens: list[int], place: Place, repeats: int) -> tuple[float, float, list[int]]:
    """Best seconds of transformers + peft greedy `generate` of NEW_TOKENS tokens (wall-clock,
    CPU), and its tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=place.dtype).to(place.device)
    model = PeftModel.from_pretrained(base, str(adapter), is_trainable=False).to(place.device, place.dtype).eval()
    ids = torch.tensor([tokens], device=place.device)
    out: list[int] = []

    def once() -> tuple[float, float]:
        nonlocal out
        start, cpu = time.perf_counter(), cpu_seconds()
        with torch.inference_mode():
            result = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        place.sync()
        elapsed = time.perf_counter() - start, cpu_seconds() - cpu
        out = result[0, len(tokens) :].tolist()
        return elapsed

    once()
    runs = [once() for _ in range(repeats)]
    return min(r[0] for r in runs), min(r[1] for r in runs), out


def bench_single(engine: Engine, model_dir: Path, adapter: Path, place: Place, repeats: int) -> None:
    tokens = prompt(0)
    floor, floor_cpu = weight_floor(model_dir, place, repeats)
    hf_s, hf_cpu, hf_tokens = hf_generate(model_dir, adapter, tokens, place, repeats)
    generate_one(engine, tokens, "a0", NEW_TOKENS)  # warm up
    runs, cpus = [], []
    for _ in range(repeats):
        cpu = cpu_seconds()
        runs.append(generate_one(engine, tokens, "a0", NEW_TOKENS))
        cpus.append(cpu_seconds() - cpu)
    engine_cpu = min(cpus)
    best = min(runs, key=lambda r: r.token_times[-1] - r.submitted)
    engine_s = best.token_times[-1] - best.submitted
    per_token = statistics.median(best.gaps)
    ours = list(_tokens(engine, tokens, "a0"))
    print(
        f"\n(1) one {NEW_TOKENS}-token greedy Generate with an adapter, prompt {PROMPT}, tp=1, {place.device} "
        f"{place.dtype} (best of {repeats})"
    )
    print(f"{'transformers + peft generate':<40}{hf_s * 1e3:>10.1f} ms")
    print(f"{'engine Generate':<40}{engine_s * 1e3:>10.1f} ms   ratio {engine_s / hf_s:.2f}x   (target <= 1.0x)")
    print(f"{'  of which time to first token':<40}{best.ttft * 1e3:>10.1f} ms")
    print(f"{'weight-streaming floor (one mv pass)':<40}{floor * 1e3:>10.1f} ms")
    print(f"{'engine per-token decode (median gap)':<40}{per_token * 1e3:>10.1f} ms   ratio {per_token / floor:.2f}x   (target <= 1.3x)")
    print(f"{'transformers per token (total / 48)':<40}{hf_s / NEW_TOKENS * 1e3:>10.1f} ms   ratio {hf_s / NEW_TOKENS / floor:.2f}x")
    print(f"{'same tokens as transformers + peft':<40}{ours == hf_tokens!s:>10}")
    print("  CPU time (this process and the ranks; best of the same runs):")
    print(f"{'  transformers + peft generate':<40}{hf_cpu * 1e3:>10.1f} ms")
    print(f"{'  engine Generate':<40}{engine_cpu * 1e3:>10.1f} ms   ratio {engine_cpu / hf_cpu:.2f}x   (target <= 1.0x)")
    print(f"{'  floor (one mv pass)':<40}{floor_cpu * 1e3:>10.1f} ms")
    print(
        f"{'  engine per token (total / 48)':<40}{engine_cpu / NEW_TOKENS * 1e3:>10.1f} ms   ratio "
        f"{engine_cpu / NEW_TOKENS / floor_cpu:.2f}x   (its prefill included)"
    )
    print(
        f"{'  transformers per token (total / 48)':<40}{hf_cpu / NEW_TOKENS * 1e3:>10.1f} ms   ratio {hf_cpu / NEW_TOKENS / floor_cpu:.2f}x"
    )


def _tokens(engine: Engine, tokens: list[int], adapter: str | None) -> list[int]:
    return [step.token_id for step in engine.submit(tokens, adapter, SamplingParams(max_tokens=NEW_TOKENS)).tokens()]


def throughput(engine: Engine, n: int, max_tokens: int) -> tuple[float, float]:
    """Generated tokens per second of `n` concurrent requests, mixed adapters and base, and
    per CPU second."""
    requests = [(prompt(100 + i), None if i % (ADAPTERS + 1) == ADAPTERS else f"a{i % (ADAPTERS + 1)}") for i in range(n)]
    start, cpu = time.perf_counter(), cpu_seconds()
    timings = concurrent(engine, requests, max_tokens)
    tokens = sum(len(t.token_times) for t in timings)
    return tokens / (time.perf_counter() - start), tokens / (cpu_seconds() - cpu)


def bench_throughput(engine: Engine, repeats: int) -> float:
    figures = {}
    for n in (1, 8, 32):
        runs = [throughput(engine, n, NEW_TOKENS) for _ in range(repeats)]
        figures[n] = (max(r[0] for r in runs), max(r[1] for r in runs))
    print(
        f"\n(2) throughput, concurrent mixed-adapter Generates ({ADAPTERS} adapters and base), prompt {PROMPT}, "
        f"{NEW_TOKENS} tokens each (best of {repeats}; then per CPU second of this process and the ranks)"
    )
    for n, (rate, per_cpu) in figures.items():
        print(
            f"{f'{n} concurrent':<40}{rate:>10.1f} tok/s   ratio {rate / figures[1][0]:.2f}x vs 1" + ("   (target >= 5x)" if n == 8 else "")
        )
        print(f"{'  per CPU second':<40}{per_cpu:>10.1f} tok/s   ratio {per_cpu / figures[1][1]:.2f}x vs 1")
    return figures[8][0]


def decode_gap(engine: Engine, adapters: list[str | None]) -> tuple[float, float]:
    """Median inter-token time while every one of the sequences decodes (after all have
    started: prefills excluded), and the CPU seconds per step of the whole run (prefills
    included: the same prompts with or without adapters)."""
    cpu = cpu_seconds()
    timings = concurrent(engine, [(prompt(200 + i), a) for i, a in enumerate(adapters)], NEW_TOKENS)
    cpu = cpu_seconds() - cpu
    start = max(t.token_times[0] for t in timings)
    gaps = [b - a for t in timings for a, b in zip(t.token_times, t.token_times[1:], strict=False) if a > start]
    return statistics.median(gaps), cpu / NEW_TOKENS


def bench_adapters(engine: Engine, repeats: int) -> None:
    base_runs = [decode_gap(engine, [None] * ADAPTERS) for _ in range(repeats)]
    mixed_runs = [decode_gap(engine, [f"a{i}" for i in range(ADAPTERS)]) for _ in range(repeats)]
    base, mixed = min(r[0] for r in base_runs), min(r[0] for r in mixed_runs)
    base_cpu, mixed_cpu = min(r[1] for r in base_runs), min(r[1] for r in mixed_runs)
    print(f"\n(3) decode step, {ADAPTERS} sequences (median inter-token time while all decode, best of {repeats})")
    print(f"{'no adapter':<40}{base * 1e3:>10.1f} ms")
    print(f"{f'{ADAPTERS} distinct adapters':<40}{mixed * 1e3:>10.1f} ms   ratio {mixed / base:.2f}x   (target <= 1.3x)")
    print(f"{'  CPU per step, no adapter':<40}{base_cpu * 1e3:>10.1f} ms   (the run / {NEW_TOKENS}, prefill included)")
    print(f"{f'  CPU per step, {ADAPTERS} distinct adapters':<40}{mixed_cpu * 1e3:>10.1f} ms   ratio {mixed_cpu / base_cpu:.2f}x")


def bench_open_loop(engine: Engine, capacity: float, requests: int, load: float) -> None:
    """Poisson arrivals at `load` x the request rate the engine sustains at 8 concurrent."""
    max_tokens = 32
    rate = load * capacity / max_tokens  # requests per second
    rng = random.Random(7)
    timings: list[Timing] = []
    lock = threading.Lock()
    lengths = [rng.randrange(8, 64) for _ in range(requests)]

    def run(i: int) -> None:
        adapter = None if i % (ADAPTERS + 1) == ADAPTERS else f"a{i % (ADAPTERS + 1)}"
        timing = generate_one(engine, prompt(300 + i, lengths[i]), adapter, max_tokens)
        with lock:
            timings.append(timing)

    threads = []
    for i in range(requests):
        thread = threading.Thread(target=run, args=(i,))
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(rate))
    for thread in threads:
        thread.join()
    ttft = [t.ttft for t in timings]
    itl = [g for t in timings for g in t.gaps]
    print(
        f"\n(4) open-loop Poisson load: {requests} requests at {rate:.2f}/s ({load:.0%} of the 8-concurrent throughput), "
        f"prompts 8-63 tokens, {max_tokens} tokens each, mixed adapters"
    )
    print(f"{'time to first token p50 / p99':<40}{percentile(ttft, 0.5) * 1e3:>10.1f} / {percentile(ttft, 0.99) * 1e3:.1f} ms")
    print(f"{'inter-token latency p50 / p99':<40}{percentile(itl, 0.5) * 1e3:>10.1f} / {percentile(itl, 0.99) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per figure (best; default 3)")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of this process (transformers, the floor) and of the engine's rank",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on cpu (bfloat16 for 1b), bfloat16 on cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="benchmark", help="the model (benchmarks/shapes.py)")
    parser.add_argument("--open-loop-requests", type=int, default=48)
    parser.add_argument("--open-loop-load", type=float, default=0.6)
    parser.add_argument("--only", choices=["1", "2", "3", "4"], action="append", help="run only these benchmarks")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    only = set(args.only or ["1", "2", "3", "4"])
    shape = SHAPES[args.shape]
    dtype = args.dtype or ("float32" if args.device == "cpu" and args.shape == "benchmark" else "bfloat16")
    place = Place(args.device, getattr(torch, dtype))
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        root = Path(tmp)
        print(
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{args.threads} threads, {args.device} {dtype}; model {args.shape}, hidden {shape.hidden_size}, {shape.num_layers} "
            f"layers, rank {RANK}"
        )
        model = write_model_as(root / "model", shape, place.dtype)
        adapters = {f"a{i}": write_adapter(root / f"a{i}", shape, rank=RANK, seed=i) for i in range(ADAPTERS)}
        config = EngineConfig(
            model_dir=model,
            topology=Topology(1, 1),
            max_lora_rank=RANK,
            max_loras_per_batch=ADAPTERS,
            kv_cache_bytes=256 << 20,
            max_num_seqs=64,
            cpu_threads=args.threads,
            device=args.device,
            dtype=dtype,
        )
        with Engine(config) as engine:
            for name, path in adapters.items():
                engine.load_adapter(name, path)
            if "1" in only:
                bench_single(engine, model, adapters["a0"], place, args.repeats)
            capacity = bench_throughput(engine, args.repeats) if {"2", "4"} & only else 0.0
            if "3" in only:
                bench_adapters(engine, args.repeats)
            if "4" in only:
                bench_open_loop(engine, capacity, args.open_loop_requests, args.open_loop_load)


if __name__ == "__main__":
    main()
