"""vLLM backend benchmark: what lorafleet's agent costs over stock vLLM.

Printed side by side from one run on one tiny model and the same adapter files, (a) per
adapter load and unload:

(1) a bare ``POST /v1/load_lora_adapter`` to one vLLM server (the floor);
(2) the agent's gRPC LoadAdapter with ``--backend vllm`` over that one server: the file://
    source under an adapter root, checked and copied (hashed on the way) to the agent's
    verified snapshot, validated against the base model, the server's ``/v1/models`` (its
    capacity), then the same POST naming the snapshot;
(3) the same over two servers (all-or-none across both: both servers asked at once);
(4) the builtin engine agent (tp=1 and tp=2) loading the same adapters over gRPC;
and (b) `kubectl apply` -> Ready for 1 and for 4 LoraAdapters, through the real control plane
(lorafleet_dev.controlplane) and the `lorafleet-operator` process, on one `lorafleet-agent serve
--backend vllm` process over the two servers beside one builtin agent process (tp=2): two
namespaces, one operator. "Ready" is polled from the API server every 0.2 s.

Each repetition loads an adapter under a fresh name, then unloads it; the rows are
interleaved so that machine noise hits all of them alike. The model is an fp32 Llama with
head_dim 32 (vLLM's CPU attention has no head_dim 16); the servers are the CPU build
``scripts/build-vllm.sh`` installs, one core and one thread each (lorafleet_dev.vllm_servers).

Run: `. scripts/bootstrap.sh && python benchmarks/bench_vllm_backend.py [--repeats N] [--no-operator]`.
CPU timings on a shared, noisy machine: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_dev.agents import AgentProcess, AgentSpec, VllmBackend
from lorafleet_dev.checkout import Checkout
from lorafleet_dev.controlplane import ControlPlane, find_bin_dir
from lorafleet_dev.processes import free_port
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from lorafleet_dev.vllm_servers import VllmProcess, VllmSettings, start_vllm_servers, vllm_python
from node_agent.agent import Agent, AgentConfig
from node_agent.backend import Backend, Capacity
from node_agent.backends.vllm import vllm_backend
from node_agent.engine import EngineBackend, EngineConfig, Topology
from node_agent.server import ServerOptions, create_server
from node_agent.sources import SourcePolicy

log = logging.getLogger("bench_vllm_backend")
REPO = Path(__file__).resolve().parents[1]
CHECKOUT = Checkout.at(REPO)
BASE_MODEL = "tiny"
SHAPE = SyntheticModel(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
CAPACITY = Capacity(max_lora_rank=16, max_loras_per_batch=2, max_loaded_loras=4)
SMALL_RANK, LARGE_RANK = 8, 16
_names = itertools.count()


@dataclass(frozen=True)
class Loader:
    """One row of the table: what it includes, and how it loads and unloads an adapter."""

    label: str
    includes: str
    load: Callable[[str, Path], None]
    unload: Callable[[str], None]


def post_json(url: str, body: dict[str, str]) -> None:
    """POST `body` as JSON; raise unless the server answers 200."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        if answer.status != 200:
            raise RuntimeError(f"{url}: {answer.status} {answer.read()!r}")


def bare_loader(server: VllmProcess) -> Loader:
    """Row 1: vLLM's own endpoints, straight to the adapter's source directory."""
    return Loader(
        "bare vLLM endpoint, 1 server",
        "one POST to /v1/load_lora_adapter (or /v1/unload_lora_adapter) naming the source directory",
        lambda name, path: post_json(f"{server.url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}),
        lambda name: post_json(f"{server.url}/v1/unload_lora_adapter", {"lora_name": name}),
    )


def grpc_loader(label: str, includes: str, stub: agent_pb2_grpc.NodeAgentStub) -> Loader:
    """Rows 2-4: the agent's LoadAdapter and UnloadAdapter over gRPC on loopback."""

    def load(name: str, path: Path) -> None:
        reply = stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=path.as_uri()), timeout=300)
        if not reply.success:
            raise RuntimeError(f"{label}: load {name}: {reply.error_message}")

    def unload(name: str) -> None:
        reply = stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=300)
        if not reply.success:
            raise RuntimeError(f"{label}: unload {name}: {reply.error_message}")

    return Loader(label, includes, load, unload)


@contextlib.contextmanager
def served_agent(backend: Backend, adapters: Path, cache: Path) -> Iterator[agent_pb2_grpc.NodeAgentStub]:
    """An in-process agent over `backend` behind the real gRPC server; its stub."""
    config = AgentConfig(agent_id=cache.name, sources=SourcePolicy(adapter_roots=(adapters,), cache_dir=cache))
    agent = Agent(backend, config)
    server = create_server(agent, ServerOptions(listen="127.0.0.1:0"))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield agent_pb2_grpc.NodeAgentStub(channel)
    finally:
        server.stop(grace=0)
        agent.close()


def time_row(loader: Loader, path: Path) -> tuple[float, float]:
    """Seconds to load `path` under a fresh name, and to unload it."""
    name = f"b{next(_names)}"
    started = time.perf_counter()
    loader.load(name, path)
    loaded = time.perf_counter()
    loader.unload(name)
    return loaded - started, time.perf_counter() - loaded


@dataclass(frozen=True)
class Samples:
    """Load and unload seconds per row label, for one kind of adapter."""

    loads: dict[str, list[float]]
    unloads: dict[str, list[float]]


def measure(loaders: list[Loader], adapters: list[Path], repeats: int) -> Samples:
    """`repeats` rounds over `adapters`, every row loading each adapter once per round."""
    samples = Samples({r.label: [] for r in loaders}, {r.label: [] for r in loaders})
    for round_ in range(repeats):
        for path in adapters:
            for loader in loaders:
                load_s, unload_s = time_row(loader, path)
                samples.loads[loader.label].append(load_s)
                samples.unloads[loader.label].append(unload_s)
        log.info("  round %d/%d done", round_ + 1, repeats)
    return samples


def print_table(title: str, loaders: list[Loader], by_label: dict[str, list[float]]) -> None:
    """min/median/max per row in milliseconds and the median's ratio to the first row's."""
    floor = statistics.median(by_label[loaders[0].label])
    print(f"\n{title}")
    print(f"{'row':<40}{'n':>4}{'min':>9}{'median':>9}{'max':>9}{'vs bare':>9}")
    for loader in loaders:
        values = [1e3 * s for s in by_label[loader.label]]
        median = statistics.median(values)
        print(f"{loader.label:<40}{len(values):>4}{min(values):>9.1f}{median:>9.1f}{max(values):>9.1f}{median / (1e3 * floor):>8.2f}x")


def print_results(loaders: list[Loader], results: dict[str, Samples], size_note: str) -> None:
    print(f"\n(a) per-adapter load and unload, milliseconds; {size_note}")
    for kind, samples in results.items():
        print_table(f"load, {kind}", loaders, samples.loads)
        print_table(f"unload, {kind}", loaders, samples.unloads)
    print("\nwhat each row includes:")
    for loader in loaders:
        print(f"  {loader.label}: {loader.includes}")


def write_files(root: Path, distinct: int) -> tuple[Path, list[Path], Path]:
    """The model, `distinct` small adapters and one larger one, all under `root`."""
    model = write_model(root / "model", SHAPE)
    small = [write_adapter(root / "adapters" / f"r{SMALL_RANK}-{i}", SHAPE, rank=SMALL_RANK, seed=i) for i in range(distinct)]
    large = write_adapter(root / "adapters" / f"r{LARGE_RANK}", SHAPE, rank=LARGE_RANK, seed=distinct)
    return model, small, large


def build_loaders(stack: contextlib.ExitStack, root: Path, model: Path, servers: list[VllmProcess]) -> list[Loader]:
    """Every row's loader; the agents and engines they need are closed by `stack`."""
    adapters = root / "adapters"
    urls = [server.url for server in servers]
    one = stack.enter_context(served_agent(vllm_backend(urls[:1], model, CAPACITY), adapters, root / "cache-vllm-1"))
    two = stack.enter_context(served_agent(vllm_backend(urls, model, CAPACITY), adapters, root / "cache-vllm-2"))
    loaders = [
        bare_loader(servers[0]),
        grpc_loader("agent --backend vllm, 1 server", "gRPC; file checks, snapshot copy + sha256, validation; GET models + POST", one),
        grpc_loader("agent --backend vllm, 2 servers", "the same, GET models + POST on both servers at once, all-or-none", two),
    ]
    for tp in (1, 2):
        log.info("starting the builtin engine, tp=%d", tp)
        config = EngineConfig(model_dir=model, topology=Topology(tp, 1), max_lora_rank=CAPACITY.max_lora_rank, max_loras_per_batch=2)
        stub = stack.enter_context(served_agent(EngineBackend.start(config), adapters, root / f"cache-engine-{tp}"))
        includes = "gRPC; file checks, snapshot copy + sha256; every rank loads the snapshot"
        loaders.append(grpc_loader(f"agent, builtin engine tp={tp}", includes, stub))
    return loaders


def adapter_manifest(name: str, path: Path) -> dict[str, object]:
    return {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraAdapter",
        "metadata": {"name": name},
        "spec": {"baseModel": BASE_MODEL, "source": {"uri": path.as_uri()}, "fleetRef": {"name": "default"}},
    }


FLEET = {
    "apiVersion": "lorafleet.dev/v1alpha1",
    "kind": "LoraFleet",
    "metadata": {"name": "default"},
    "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "lorafleet-agent"}}},
}


def apply_and_wait(cluster: ControlPlane, ns: str, paths: list[Path], timeout_s: float = 300) -> float:
    """Seconds from the apply of one LoraAdapter per path (one request) until all are Ready."""
    items = [adapter_manifest(f"a{i}", path) for i, path in enumerate(paths)]
    started = time.perf_counter()
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}), ns)
    while True:
        listed = cluster.kubectl_json("get", "la", "-n", ns)["items"]
        if sum((i.get("status") or {}).get("phase") == "Ready" for i in listed) == len(paths):
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"{ns}: not every adapter Ready after {timeout_s}s")
        time.sleep(0.2)


def start_fleet_agent(stack: contextlib.ExitStack, cluster: ControlPlane, agent: AgentProcess, vllm_port: int | None) -> str:
    """Start `agent`, and give it a namespace of its own with its Pod and the default fleet."""
    stack.callback(agent.stop)
    agent.start().wait_ready(300)
    ns = cluster.create_namespace(f"bench-{agent.name}")
    cluster.create_agent_pod(ns, agent.name, agent.port, vllm_port=vllm_port)
    cluster.apply(json.dumps(FLEET), ns)
    return ns


def start_operator(stack: contextlib.ExitStack, cluster: ControlPlane, namespaces: list[str], log_path: Path) -> None:
    """`lorafleet-operator` managing `namespaces`, stopped with SIGTERM on exit."""
    env = {
        **cluster.tool_env(),
        "LORAFLEET_WATCH_NAMESPACES": ",".join(namespaces),
        "LORAFLEET_LEASE_NAMESPACE": namespaces[0],
        "LORAFLEET_METRICS_PORT": str(free_port()),
        "LORAFLEET_LOG_LEVEL": "WARNING",
    }
    with open(log_path, "wb") as out:
        operator = subprocess.Popen(["lorafleet-operator"], stdout=out, stderr=subprocess.STDOUT, env=env)
    stack.callback(operator.wait, 30)  # callbacks run last-in first-out: terminate, then wait
    stack.callback(operator.terminate)


def started_cluster(stack: contextlib.ExitStack) -> ControlPlane:
    """The real control plane with lorafleet's CRDs established, stopped by `stack`."""
    log.info("starting the control plane")
    cluster = ControlPlane.start(find_bin_dir(CHECKOUT))
    stack.callback(cluster.stop)
    cluster.kubectl("apply", "--server-side", "-f", str(CHECKOUT.crds))
    crds = ("crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev")
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
    return cluster


def bench_apply_ready(root: Path, model: Path, servers: list[VllmProcess], adapters: list[Path], repeats: int) -> None:
    """(b): apply -> Ready for 1 and for all of `adapters`, the vLLM agent beside the builtin one."""
    with contextlib.ExitStack() as stack:
        cluster = started_cluster(stack)
        builtin = AgentSpec(model, (root / "adapters",), BASE_MODEL, tp=2, dp=1, max_loaded_loras=CAPACITY.max_loaded_loras)
        vllm = VllmBackend(tuple(s.url for s in servers), root / "cache-agent-vllm", CAPACITY.max_loras_per_batch)
        rows = {
            "agent --backend vllm, 2 servers": AgentProcess("vllm", dataclasses.replace(builtin, vllm=vllm), root / "logs"),
            "agent, builtin engine tp=2": AgentProcess("builtin", builtin, root / "logs"),
        }
        namespaces = {
            label: start_fleet_agent(stack, cluster, agent, servers[0].port if agent.spec.vllm else None) for label, agent in rows.items()
        }
        start_operator(stack, cluster, list(namespaces.values()), root / "logs" / "operator.log")
        sizes = sorted({1, len(adapters)})
        seconds: dict[tuple[str, int], list[float]] = {}
        for round_ in range(repeats + 1):  # round 0 warms up: the operator's start is not measured
            for n in sizes:
                for label, ns in namespaces.items():
                    taken = apply_and_wait(cluster, ns, adapters[:n])
                    if round_:
                        seconds.setdefault((label, n), []).append(taken)
                    cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=300s")
            log.info("  round %d/%d done%s", round_, repeats, " (warm-up)" if not round_ else "")
    print(f"\n(b) kubectl apply -> Ready, seconds, one agent of 2 ranks per row, {repeats} rounds (polled every 0.2 s)")
    print(f"{'row':<40}{'adapters':>9}{'min':>8}{'median':>8}{'max':>8}{'vs builtin':>11}")
    for (label, n), values in seconds.items():
        floor = statistics.median(seconds[("agent, builtin engine tp=2", n)])
        median = statistics.median(values)
        print(f"{label:<40}{n:>9}{min(values):>8.2f}{median:>8.2f}{max(values):>8.2f}{median / floor:>10.2f}x")


def bench_loads(
    stack: contextlib.ExitStack, root: Path, files: tuple[Path, list[Path], Path], servers: list[VllmProcess], repeats: int
) -> None:
    """(a): every row loading the small adapters and the large one, `repeats` rounds."""
    model, small, large = files
    loaders = build_loaders(stack, root, model, servers)
    log.info("warm-up: one untimed load and unload per row")
    measure(loaders, small[:1], 1)
    results: dict[str, Samples] = {}
    for kind, paths in ((f"{len(small)} distinct rank-{SMALL_RANK} adapters", small), (f"one rank-{LARGE_RANK} adapter", [large])):
        log.info("(a) timing %s, %d rounds", kind, repeats)
        results[kind] = measure(loaders, paths, repeats)
    sizes = {p.name: (p / "adapter_model.safetensors").stat().st_size / 2**10 for p in (small[0], large)}
    note = ", ".join(f"{name}: {kib:.0f} KiB" for name, kib in sizes.items())
    print_results(loaders, results, f"model hidden {SHAPE.hidden_size}, {SHAPE.num_layers} layers, all 7 modules; {note}")


def stop_cleanly_on_signals() -> None:
    """SIGTERM, and SIGINT even where a shell started us in the background (which ignores it),
    raise KeyboardInterrupt like Ctrl-C: the exit stacks then kill every server and agent, the
    operator and the control plane (vLLM servers told by the kernel alone can outlive us)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8, help="rounds over the adapters in (a) (default 8)")
    parser.add_argument("--adapters", type=int, default=4, help=f"distinct rank-{SMALL_RANK} adapters (default 4, at most 4)")
    parser.add_argument("--apply-repeats", type=int, default=5, help="rounds of apply -> Ready in (b) (default 5)")
    parser.add_argument("--no-operator", action="store_true", help="skip (b), apply -> Ready (no control plane)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    stop_cleanly_on_signals()
    python = vllm_python(REPO)
    if python is None:
        raise SystemExit("stock vLLM is not installed: run `bash scripts/build-vllm.sh` first")
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-vllm-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        files = write_files(root, min(args.adapters, CAPACITY.max_loaded_loras))
        settings = VllmSettings(python, files[0], CAPACITY.max_lora_rank, CAPACITY.max_loras_per_batch, CAPACITY.max_loaded_loras)
        servers = [VllmProcess(f"vllm-{core}", settings, core, root / "logs") for core in range(2)]
        log.info("starting 2 vLLM servers (logs in %s)", root / "logs")
        for server in servers:
            stack.callback(server.kill)
        start_vllm_servers(servers)
        bench_loads(stack, root, files, servers, args.repeats)
        if not args.no_operator:
            bench_apply_ready(root, files[0], servers, files[1], args.apply_repeats)


if __name__ == "__main__":
    main()
