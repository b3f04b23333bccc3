#!/usr/bin/env python3
"""The one prepared GPU check (docs/kernels.md, "GPU figures"): one call, at most ten minutes
on an H100, when a GPU is lent. It measures, on the device:

1. kernels: the paged-decode attention and the LoRA shrink/expand kernels (what `dispatch`
   picks: triton on CUDA) on 8B-class shapes, each against the bytes it must move at least:
   achieved GB/s and its fraction of the device's peak memory bandwidth; the largest difference
   from the torch path on the same inputs;
2. decode: the engine's model (tp 1, its layers and kernels, in this process, no driver) on an
   8B-parameter Llama shape with random bf16 weights: a decode step of `--seqs` sequences with
   8 distinct adapters and with none, tokens/s, against the weight-streaming floor at the peak;
3. greedy: the engine (rank process, scheduler) generating greedy tokens on a small bf16 model
   with 4 adapters, with its device kernels and with `LORAFLEET_KERNELS=torch` (torch on the
   same device, the reference): equal tokens.

It writes `report.md` into `--out` and prints it. Its own logic (arguments, the bandwidth
arithmetic, the report) runs on the CPU too: `--device cpu --shape tiny` (the kernels through
triton's interpreter, `TRITON_INTERPRET=1`), as `tests/kernels/test_gpu_check.py` runs it.

    python benchmarks/gpu_check.py [--out DIR] [--peak-gbps N]   (peak: from the device's name)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

if importlib.util.find_spec("node_agent") is None:  # a bare GPU machine: the checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "devtools"))
sys.path.insert(0, str(Path(__file__).parent))  # its sibling `shapes`, when imported from elsewhere

from shapes import SHAPES, write_model_as

from lorafleet_dev.synthetic import SyntheticModel, write_adapter
from node_agent.engine import Engine, EngineConfig
from node_agent.engine.kernels import LoraBatch, dispatch, paged_attention, torch_ops
from node_agent.engine.model.context import AttentionBatch, ForwardContext, RankSetup, block_table_tensor
from node_agent.engine.model.decoder import CausalLM
from node_agent.engine.model.lora_layers import LoraCapacity, SliceWeights
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.distributed import ProcessGroups
from node_agent.engine.parallel.sharding import ShardGroup
from node_agent.engine.parallel.topology import Topology
from node_agent.engine.serving.kv_cache import PagedKVCache, kv_cache_layout
from node_agent.engine.serving.sampler import SamplingParams, TokenLogprobs

# Peak memory bandwidth by device name (GB/s, the vendors' figures); the first match is taken.
PEAK_GBPS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0), ("A100", 2039.0), ("L40S", 864.0))
MODEL_SHAPES = {
    "8b": SyntheticModel(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256
    ),
    "tiny": SyntheticModel(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=512),
}
ADAPTERS = 8
RANK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")), help="default: $OUT, else ./gpu-check")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the check's own logic, on a tiny shape")
    parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="8b")
    parser.add_argument("--peak-gbps", type=float, help="the device's peak memory bandwidth (default: from its name)")
    parser.add_argument("--seqs", type=int, default=8, help="sequences in the decode step")
    parser.add_argument("--context", type=int, default=1024, help="tokens of context of each decoding sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed repetitions of each kernel and decode step")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per request in (3)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --device cpu --shape tiny to check the script itself")
    return args


def peak_gbps(device_name: str) -> float | None:
    """The peak memory bandwidth of a device by its name; None for one not in PEAK_GBPS."""
    return next((gbps for key, gbps in PEAK_GBPS if key.lower() in device_name.lower()), None)


def paged_decode_bytes(seqs: int, context: int, heads: int, kv_heads: int, head_dim: int, element: int) -> int:
    """The least a decode step's attention reads and writes: every sequence's cached K and V,
    its query and its output."""
    return 2 * seqs * context * kv_heads * head_dim * element + 2 * seqs * heads * head_dim * element


def shrink_bytes(tokens: int, in_features: int, rank: int, slices: int, adapters: int, element: int) -> int:
    """x, every adapter's A of every slice, and the fp32 result."""
    return tokens * in_features * element + adapters * slices * rank * in_features * element + slices * tokens * rank * 4


def expand_bytes(tokens: int, widths: tuple[int, ...], rank: int, adapters: int, element: int) -> int:
    """The fp32 shrink result, every adapter's B of every slice, and `out` read and written."""
    return len(widths) * tokens * rank * 4 + adapters * sum(widths) * rank * element + 2 * tokens * sum(widths) * element


def weight_bytes(shape: SyntheticModel, element: int) -> int:
    """Every weight matrix (embedding excluded: a step reads one row of it; LM head included)."""
    return (
        shape.num_layers * sum(out * inp for out, inp in shape.module_shapes().values()) + shape.vocab_size * shape.hidden_size
    ) * element


def gbps(moved: int, seconds: float) -> float:
    return moved / seconds / 1e9


@dataclass
class Report:
    """What the check found, as the lines of report.md."""

    device: str
    peak: float | None
    lines: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def fraction(self, rate: float) -> str:
        return "n/a" if self.peak is None else f"{100 * rate / self.peak:.1f}%"

    def text(self) -> str:
        peak = "unknown (pass --peak-gbps)" if self.peak is None else f"{self.peak:.0f} GB/s"
        verdict = "all checks passed" if not self.failed else "FAILED: " + "; ".join(self.failed)
        return "\n".join([f"# GPU check: {self.device}", "", f"peak memory bandwidth {peak}; {verdict}", "", *self.lines, ""])


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` after two warm-up calls (CUDA events on the GPU)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


@contextlib.contextmanager
def kernels_mode(mode: str) -> Iterator[None]:
    """`LORAFLEET_KERNELS` set to `mode` for the block (and processes it starts)."""
    before = os.environ.get(dispatch.MODE_ENV)
    os.environ[dispatch.MODE_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ[dispatch.MODE_ENV]
        else:
            os.environ[dispatch.MODE_ENV] = before


def device_mode(device: torch.device) -> str:
    """The kernels measured: triton's (on the CPU only under its interpreter)."""
    return "triton" if device.type == "cpu" else "auto"


def kernel_row(report: Report, name: str, moved: int, seconds: float, error: float, limit: float) -> None:
    rate = gbps(moved, seconds)
    report.lines.append(f"| {name} | {moved / 1e6:.1f} | {seconds * 1e6:.1f} | {rate:.0f} | {report.fraction(rate)} | {error:.1e} |")
    if not error <= limit:
        report.failed.append(f"{name}: differs from the torch path by {error:.1e} (limit {limit:.0e})")


def check_kernels(report: Report, args: argparse.Namespace, device: torch.device) -> None:
    """(1) The paged-decode and shrink/expand kernels against the bytes they move."""
    shape, dtype, block = MODEL_SHAPES[args.shape], torch.bfloat16, 16
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    per_seq = -(-args.context // block)
    keys, values = (torch.randn(args.seqs * per_seq, block, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
    tables = torch.randperm(args.seqs * per_seq, device=device).view(args.seqs, per_seq).to(torch.int32)
    cache = paged_attention.PagedLayer(keys, values, tables)
    lengths = torch.full((args.seqs,), args.context, dtype=torch.int32, device=device)
    q = torch.randn(args.seqs, heads, head_dim, device=device, dtype=dtype)
    report.lines += [
        "## (1) kernels",
        "",
        "| kernel | MB moved | us | GB/s | of peak | max abs diff vs torch |",
        "|---|---|---|---|---|---|",
    ]
    with kernels_mode(device_mode(device)):
        seconds = timed(lambda: dispatch.paged_decode(q, cache, lengths, head_dim**-0.5), device, args.steps)
        got = dispatch.paged_decode(q, cache, lengths, head_dim**-0.5)
    error = float((got.float() - paged_attention.decode_torch(q, cache, lengths, head_dim**-0.5).float()).abs().max())
    moved = paged_decode_bytes(args.seqs, args.context, heads, kv_heads, head_dim, 2)
    kernel_row(report, f"paged decode, {args.seqs} seqs x {args.context} tokens", moved, seconds, error, 2e-2)
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    a_stacks = [torch.randn(ADAPTERS, RANK, shape.hidden_size, device=device, dtype=dtype) * 0.05 for _ in widths]
    b_stacks = [torch.randn(ADAPTERS, width, RANK, device=device, dtype=dtype) * 0.05 for width in widths]
    scales = torch.ones(len(widths), ADAPTERS, device=device)
    batch = LoraBatch.from_token_slots(torch.arange(args.seqs, dtype=torch.int32, device=device) % ADAPTERS)
    x = torch.randn(args.seqs, shape.hidden_size, device=device, dtype=dtype)
    out = torch.zeros(args.seqs, sum(widths), device=device, dtype=dtype)
    used = min(args.seqs, ADAPTERS)
    with kernels_mode(device_mode(device)):
        seconds = timed(lambda: dispatch.shrink(x, a_stacks, batch), device, args.steps)
        shrunk = dispatch.shrink(x, a_stacks, batch)
        expand_seconds = timed(lambda: dispatch.expand(shrunk, b_stacks, scales, batch, out), device, args.steps)
        expanded = torch.zeros_like(out)
        dispatch.expand(shrunk, b_stacks, scales, batch, expanded)
    want = torch_ops.shrink(x, a_stacks, batch)
    error = float((shrunk - want).abs().max())
    moved = shrink_bytes(args.seqs, shape.hidden_size, RANK, len(widths), used, 2)
    kernel_row(report, f"shrink, qkv, {used} adapters, {args.seqs} tokens", moved, seconds, error, 1e-2)
    reference = torch.zeros_like(out)
    torch_ops.expand(want, b_stacks, scales, batch, reference)
    error = float((expanded.float() - reference.float()).abs().max())
    moved = expand_bytes(args.seqs, widths, RANK, used, 2)
    kernel_row(report, f"expand, qkv, {used} adapters, {args.seqs} tokens", moved, expand_seconds, error, 2e-2)
    report.lines.append("")


def decode_model(shape: SyntheticModel, device: torch.device, config_dir: Path) -> CausalLM:
    """The engine's model (tp 1) of `shape` in bf16 on `device`, random weights, adapters in
    slots 1..ADAPTERS of every module."""
    (config_dir / "config.json").write_text(json.dumps(shape.config()))
    cfg = ModelConfig.from_dir(config_dir)
    groups = ProcessGroups(dict.fromkeys(ShardGroup))
    model = CausalLM(RankSetup(cfg, Topology(1, 1), 0, groups, LoraCapacity(RANK, ADAPTERS + 1, False), torch.bfloat16, device))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.02)
            else:
                parameter.fill_(1.0)
        for module in model.lora_modules().values():
            for slot in range(1, ADAPTERS + 1):
                weights = [
                    SliceWeights(torch.randn(a, device=device) * 0.02, torch.randn(b, device=device) * 0.02, 2.0)
                    for a, b in module.slot_shapes()
                ]
                module.set_slot(slot, list(weights))
    return model


def decode_step(model: CausalLM, kv: PagedKVCache, context: int, slots: list[int]) -> Callable[[], object]:
    """One decode step of a sequence per entry of `slots` (its adapter slot, -1: none) at
    position `context`, each sequence on its own consecutive blocks."""
    device, block, seqs = model.inv_freq.device, kv.layout.block_size, len(slots)
    per_seq = -(-(context + 1) // block)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    cos, sin = model.rope_tables([context] * seqs)
    lora = LoraBatch.from_token_slots(torch.tensor(slots, device=device))
    mapping = torch.tensor([table[0] * block + context for table in tables], device=device)
    attention = AttentionBatch(kv, mapping, block_table_tensor(tables, device), [1] * seqs, [context + 1] * seqs)
    ctx = ForwardContext([seqs], 0, 0, lora, lora, cos, sin, attention, torch.arange(seqs, device=device))
    tokens = torch.arange(1, seqs + 1, device=device)
    return lambda: model(tokens, ctx)


def check_decode(report: Report, args: argparse.Namespace, device: torch.device) -> None:
    """(2) Decode tokens/s of the engine's model with 8 adapters and with none."""
    shape = MODEL_SHAPES[args.shape]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        model = decode_model(shape, device, Path(tmp))
    layout = kv_cache_layout(model.cfg, Topology(1, 1), 0, 16, torch.bfloat16)
    kv = PagedKVCache(layout, args.seqs * -(-(args.context + 1) // 16), device)
    base = timed(decode_step(model, kv, args.context, [-1] * args.seqs), device, args.steps)
    mixed = timed(decode_step(model, kv, args.context, [1 + i % ADAPTERS for i in range(args.seqs)]), device, args.steps)
    floor = None if report.peak is None else weight_bytes(shape, 2) / (report.peak * 1e9)
    report.lines += [
        f"## (2) decode: the engine's model, {args.shape} Llama shape, bf16, {args.seqs} sequences at {args.context} tokens",
        "",
        "| adapters | step ms | tokens/s | weight-streaming floor ms |",
        "|---|---|---|---|",
        f"| none | {base * 1e3:.2f} | {args.seqs / base:.0f} | {'n/a' if floor is None else f'{floor * 1e3:.2f}'} |",
        f"| {ADAPTERS} distinct | {mixed * 1e3:.2f} | {args.seqs / mixed:.0f} | |",
        "",
        f"{ADAPTERS} adapters cost {mixed / base:.2f}x the step without.",
        "",
    ]


GREEDY_MARGIN = 0.0625  # logprob gap under which bf16 rounding alone may flip a greedy token (see check_greedy)


def generate(
    config: EngineConfig, adapters: dict[str, Path], requests: list[tuple[list[int], str | None]], tokens: int
) -> list[list[tuple[int, float]]]:
    """Each request's greedy tokens, each with its top-two logprob gap (the margin of its choice)."""
    with Engine(config) as engine:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        handles = [engine.submit(prompt, adapter, SamplingParams(max_tokens=tokens, logprobs=2)) for prompt, adapter in requests]
        return [[(step.token_id, margin(step.logprobs)) for step in handle.tokens()] for handle in handles]


def margin(logprobs: TokenLogprobs | None) -> float:
    if logprobs is None or len(logprobs.top_logprobs) < 2:
        raise ValueError("the engine returned no top-two logprobs")
    return logprobs.top_logprobs[0] - logprobs.top_logprobs[1]


def first_real_difference(ours: list[tuple[int, float]], reference: list[tuple[int, float]]) -> int | None:
    """The first step whose tokens differ though the reference's margin there is at least
    GREEDY_MARGIN; None if there is none. Tokens after a first difference are not compared: the
    sequences rightly part there."""
    for index, ((token, _), (want, gap)) in enumerate(zip(ours, reference, strict=True)):
        if token != want:
            return index if gap >= GREEDY_MARGIN else None
    return None


def check_greedy(report: Report, args: argparse.Namespace, device: torch.device) -> None:
    """(3) The engine's greedy tokens with the device's kernels against torch on the device: equal,
    except from a step where the reference's top two logprobs are within GREEDY_MARGIN (bf16
    logits of this model are O(1) to O(10): the two paths' rounding, a few units of 2^-8
    relative, can move them by a few hundredths, so a closer choice may go either way)."""
    shape = MODEL_SHAPES["tiny"] if args.shape == "tiny" else SHAPES["benchmark"]
    generator = torch.Generator().manual_seed(0)
    names = ["a0", "a1", "a2", None]
    requests = [(torch.randint(0, shape.vocab_size, (8 + 5 * i,), generator=generator).tolist(), name) for i, name in enumerate(names)]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        model = write_model_as(Path(tmp) / "model", shape, torch.bfloat16)
        adapters = {f"a{i}": write_adapter(Path(tmp) / f"a{i}", shape, rank=RANK, seed=i) for i in range(3)}
        config = EngineConfig(model_dir=model, topology=Topology(1, 1), max_lora_rank=RANK, device=device.type, dtype="bfloat16")
        runs = {}
        for mode in (device_mode(device), "torch"):
            with kernels_mode(mode):
                runs[mode] = generate(config, adapters, requests, args.new_tokens)
    report.lines += [
        f"## (3) greedy tokens, {len(requests)} requests x {args.new_tokens}, the kernels against torch on the device",
        "",
        f"(equal up to a step whose reference margin is under {GREEDY_MARGIN}; nothing after it is compared)",
        "",
    ]
    for index, (ours, reference) in enumerate(zip(runs[device_mode(device)], runs["torch"], strict=True)):
        tokens, wanted = [t for t, _ in ours], [t for t, _ in reference]
        wrong = first_real_difference(ours, reference)
        verdict = "equal" if tokens == wanted else f"equal until a close call: {tokens} vs {wanted}"
        if wrong is not None:
            verdict = f"DIFFER at step {wrong} (margin {reference[wrong][1]:.3f}): {tokens} vs {wanted}"
            report.failed.append(f"greedy request {index} differs from the torch reference at step {wrong}")
        report.lines.append(f"- request {index} (adapter {requests[index][1]}): {verdict}")
    report.lines.append("")


SECTIONS: dict[str, Callable[[Report, argparse.Namespace, torch.device], None]] = {
    "kernels": check_kernels,
    "decode": check_decode,
    "greedy": check_greedy,
}


def main(argv: list[str] | None = None) -> int:
    """Run every section (a failing one is reported, the others still run); 1 if any failed."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # triton's kernels on the CPU run interpreted
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (the check's own logic, not a measurement)"
    report = Report(name, args.peak_gbps or peak_gbps(name))
    for title, section in SECTIONS.items():
        started = time.monotonic()
        try:
            section(report, args, device)
        except Exception as error:  # one section's failure is reported, the rest still run
            report.failed.append(f"{title}: {type(error).__name__}: {error}")
        report.lines.append(f"({title}: {time.monotonic() - started:.0f} s)")
        report.lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(report.text())
    print(report.text())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
