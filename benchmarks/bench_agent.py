"""Node agent benchmarks, printed side by side from one run on one engine (tp=2, dp=2):

(a) loading one adapter: over gRPC (LoadAdapter on a loopback server) vs the same load
    in-process, both through the agent (`Agent.load`: source checks, sha256, per-rank results)
    and straight into the engine (`Engine.load_adapter`); beside them, one `describe` fan-out to
    every rank (what each load cost on top before load replies carried the ranks' holdings);
(b) Forward throughput for a batch of 8 sequences x 32 tokens that all use 1 adapter vs 8
    distinct adapters, over gRPC and in-process.

The model and adapters match benchmarks/bench_engine.py (hidden 1024, 4 layers, rank 16 on all
7 modules). Run: `. scripts/bootstrap.sh && python benchmarks/bench_agent.py [--repeats N]`.
CPU timings on a shared machine are noisy: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.synthetic import BENCHMARK_MODEL, write_adapter, write_model
from node_agent.agent import Agent, AgentConfig
from node_agent.engine import Engine, EngineBackend, EngineConfig, Topology
from node_agent.server import ServerOptions, create_server
from node_agent.sources import SourcePolicy

SHAPE = BENCHMARK_MODEL
RANK = 16
BATCH, TOKENS = 8, 32
# 8 x 32 x 8192 float32 logits are 8 MiB, over gRPC's default 4 MiB receive limit.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 * 2**20)]
_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}{next(_names)}"


def spread(samples: list[float]) -> str:
    """Median and range in milliseconds."""
    return f"{statistics.median(samples) * 1e3:>9.1f} ms  ({min(samples) * 1e3:.1f}-{max(samples) * 1e3:.1f})"


def time_once(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def bench_load(agent: Agent, engine: Engine, stub: agent_pb2_grpc.NodeAgentStub, adapter: Path, repeats: int) -> None:
    samples: dict[str, list[float]] = {"engine": [], "agent": [], "grpc": [], "describe": []}
    uri = adapter.as_uri()
    for _ in range(repeats):  # interleaved, so that machine noise hits all of them alike
        engine_name, agent_name, grpc_name = fresh("e"), fresh("a"), fresh("g")
        samples["engine"].append(time_once(functools.partial(engine.load_adapter, engine_name, adapter)))
        engine.unload_adapter(engine_name)
        samples["agent"].append(time_once(functools.partial(agent.load, agent_name, uri)))
        agent.unload(agent_name)
        request = pb.LoadAdapterRequest(name=grpc_name, source_uri=uri)
        samples["grpc"].append(time_once(functools.partial(stub.LoadAdapter, request, timeout=300)))
        stub.UnloadAdapter(pb.UnloadAdapterRequest(name=grpc_name), timeout=300)
        samples["describe"].append(time_once(engine.describe))
    size = (adapter / "adapter_model.safetensors").stat().st_size / 2**20
    engine = statistics.median(samples["engine"])
    print(
        f"\n(a) adapter load on tp=2 dp=2, rank {RANK}, {SHAPE.num_layers} layers x 7 modules, file {size:.2f} MiB, "
        f"{repeats} repeats (median, range)"
    )
    print(f"{'Engine.load_adapter (in-process)':<40}{spread(samples['engine'])}")
    for key, label in (("agent", "Agent.load (in-process)"), ("grpc", "LoadAdapter over gRPC"), ("describe", "one describe fan-out")):
        ratio = statistics.median(samples[key]) / engine
        print(f"{label:<40}{spread(samples[key])}   {ratio:.2f}x the engine load")


def bench_forward(agent: Agent, stub: agent_pb2_grpc.NodeAgentStub, adapters: list[Path], repeats: int) -> None:
    names = [fresh("f") for _ in adapters]
    for name, path in zip(names, adapters, strict=True):
        agent.load(name, path.as_uri())
    tokens = [[(7 * i + j) % SHAPE.vocab_size for j in range(TOKENS)] for i in range(BATCH)]
    batches = {"1 adapter": [names[0]] * BATCH, "8 adapters": names[:BATCH]}
    samples: dict[tuple[str, str], list[float]] = {}
    for label, used in batches.items():
        sequences = list(zip(tokens, used, strict=True))
        request = pb.ForwardRequest(sequences=[pb.Sequence(token_ids=t, adapter=a) for t, a in sequences])
        agent.forward(sequences)  # warm up: make the adapters resident
        in_process = functools.partial(agent.forward, sequences)
        over_grpc = functools.partial(stub.Forward, request, timeout=300)
        for _ in range(repeats):
            samples.setdefault((label, "in-process"), []).append(time_once(in_process))
            samples.setdefault((label, "gRPC"), []).append(time_once(over_grpc))
    print(
        f"\n(b) Forward, tp=2 dp=2, {BATCH} sequences x {TOKENS} tokens, vocab {SHAPE.vocab_size} "
        f"({BATCH * TOKENS * SHAPE.vocab_size * 4 / 2**20:.0f} MiB of logits), {repeats} repeats"
    )
    print(f"{'batch':<14}{'path':<12}{'latency (median, range)':>32}{'tokens/s':>12}")
    for (label, path), values in samples.items():
        print(f"{label:<14}{path:<12}{spread(values):>32}{BATCH * TOKENS / statistics.median(values):>12.0f}")
    one, eight = (statistics.median(samples[(label, "gRPC")]) for label in batches)
    print(f"8 adapters vs 1 adapter over gRPC: {eight / one:.2f}x the latency")
    for name in names:
        agent.unload(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions per figure (default 7)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-agent-") as tmp:
        root = Path(tmp)
        print(f"generating a {SHAPE.hidden_size}-hidden, {SHAPE.num_layers}-layer model and 8 adapters in {root}")
        model = write_model(root / "model", SHAPE)
        adapters = [write_adapter(root / "adapters" / f"a{i}", SHAPE, rank=RANK, seed=i) for i in range(8)]
        engine_config = EngineConfig(model_dir=model, topology=Topology(2, 2), max_lora_rank=RANK, max_loras_per_batch=8)
        config = AgentConfig(sources=SourcePolicy(adapter_roots=(root / "adapters",)))
        backend = EngineBackend.start(engine_config)
        with Agent(backend, config) as agent:
            server = create_server(agent, ServerOptions())
            server.start()
            with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as channel:
                stub = agent_pb2_grpc.NodeAgentStub(channel)
                bench_load(agent, backend.engine, stub, adapters[0], args.repeats)
                bench_forward(agent, stub, adapters, args.repeats)
            server.stop(grace=0)


if __name__ == "__main__":
    main()
