"""Time to first token over 4× more adapters than slots, on real agents: scaling by demand
(``spec.scaling``, minReplicas 0: standby everywhere, loaded on first request) beside fixed
replicas (``spec.replicas: 1``) and beside every adapter resident everywhere, from one run with
one seeded request trace (issue 38's acceptance; docs/scaling.md, "Measured").

Everything is real: the control plane (lorafleet_dev.controlplane), the `lorafleet-operator`
process, and `lorafleet-agent serve` processes (builtin engine, tp=1 dp=1, on the CPU, the
tiny generated model: hidden 64, 2 layers, 4 heads, vocabulary 256; adapters of rank 8) with
their OpenAI HTTP API. Each mode gets fresh agents (their `--max-loaded-loras` differs) and a
fresh operator in a namespace of its own.

The workload: adapters = 4 × the slots of the scaling and fixed modes (agents × slots per
agent); requests arrive open-loop (Poisson, seeded) and name adapters by a Zipf law (seeded);
each is a streamed `/v1/completions`, 8 prompt tokens, 4 generated (greedy). TTFT is
measured here, from the request's send to the arrival of the first token's event (the agent
sends its status only with the first token). Requests are routed as a gateway would: to a
pod that the adapter's EndpointSlices list (read from the API server, refreshed every second;
the route draw of the trace picks among them), else to any agent of the fleet. A request that is refused or ends in an error
is a failure; percentiles count failures as infinitely slow ("failed" when one is reached).

Per mode: p50/p99 TTFT, failures, requests whose adapter no slice listed, slot loads during
the trace (the agents' `vllm:lora_adapter_load_seconds` count: standby adapters loaded onto
the ranks) and the operator's LoadAdapter calls during it, the slots held (most resident
adapters summed over the agents, sampled every half second) and the slots configured.

Run: `. scripts/bootstrap.sh && python benchmarks/bench_scaling_ttft.py [--quick]`.
CPU timings on a shared 2-core machine: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

import grpc
import numpy as np
import requests

from lorafleet.v1 import agent_pb2, agent_pb2_grpc
from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.checkout import Checkout
from lorafleet_dev.controlplane import ControlPlane, find_bin_dir
from lorafleet_dev.node import machine_ip
from lorafleet_dev.processes import free_port
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from lorafleet_operator.routing import ADAPTER_ANNOTATION

log = logging.getLogger("bench_scaling_ttft")
CHECKOUT = Checkout.at(Path(__file__).resolve().parents[1])
SHAPE = SyntheticModel()
BASE_MODEL = "tiny"
FLEET_LABEL = "lorafleet.dev/fleet"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
MAX_TOKENS = 4
#: The operator's intervals, short so that drift checks (and demand samples) come every second.
OPERATOR_ENV = {
    "LORAFLEET_DRIFT_INTERVAL_SECONDS": "1",
    "LORAFLEET_CALL_DEADLINE_SECONDS": "5",
    "LORAFLEET_LOAD_DEADLINE_SECONDS": "60",
    "LORAFLEET_LEASE_DURATION_SECONDS": "3",
    "LORAFLEET_LOG_LEVEL": "INFO",
}
RESIDENT = agent_pb2.ADAPTER_RESIDENCY_RESIDENT


# ---- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: when it is sent (seconds from the start), which adapter it
    names (0 is the most popular), and a draw in [0, 1) that picks among the pods routed."""

    at_s: float
    adapter: int
    route: float


def zipf_trace(adapters: int, requests_n: int, rate: float, exponent: float, seed: int) -> tuple[TraceRequest, ...]:
    """A seeded open-loop trace: Poisson arrivals at ``rate`` per second, adapter k (0-based)
    drawn with probability ∝ (k + 1)^-exponent."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, adapters + 1, dtype=float) ** -exponent
    chosen = rng.choice(adapters, size=requests_n, p=weights / weights.sum())
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=requests_n))
    routes = rng.random(requests_n)
    return tuple(TraceRequest(float(t), int(a), float(r)) for t, a, r in zip(arrivals, chosen, routes, strict=True))


def pick(route: float, choices: Sequence[str]) -> str:
    """The choice a route draw picks (choices in a fixed order, so a trace replays alike)."""
    return sorted(choices)[min(int(route * len(choices)), len(choices) - 1)]


# ---- results and the target -----------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request: its TTFT (None when it failed), the error, and whether a slice listed a
    pod for its adapter when it was sent."""

    ttft_s: float | None
    error: str = ""
    listed: bool = True


@dataclass(frozen=True)
class ModeResult:
    """What one mode measured."""

    mode: str
    outcomes: tuple[Outcome, ...]
    slot_loads: int
    operator_loads: int
    slots_held: int
    slots_configured: int

    @property
    def failures(self) -> int:
        return sum(o.ttft_s is None for o in self.outcomes)

    @property
    def unlisted(self) -> int:
        return sum(not o.listed for o in self.outcomes)

    def ttft_percentile(self, q: float) -> float:
        """The q-th percentile of TTFT in seconds (nearest rank: the value at rank ⌈q·n/100⌉), a
        failure counting as infinitely slow: ``inf`` once failures reach that rank."""
        values = [math.inf if o.ttft_s is None else o.ttft_s for o in self.outcomes]
        return float(np.percentile(values, q, method="inverted_cdf")) if values else math.nan


@dataclass(frozen=True)
class TargetCheck:
    """Issue 38's target: scaling's p99 within 2× all-resident's, with at most a quarter of
    the slots all-resident holds."""

    p99_ratio: float
    slot_ratio: float

    @property
    def met(self) -> bool:
        return self.p99_ratio <= 2.0 and self.slot_ratio <= 0.25


def target_check(scaling: ModeResult, resident: ModeResult) -> TargetCheck:
    """The target's two ratios: scaling's configured slots (the most it can hold) against the
    slots all-resident held."""
    return TargetCheck(
        p99_ratio=scaling.ttft_percentile(99) / resident.ttft_percentile(99),
        slot_ratio=scaling.slots_configured / resident.slots_held,
    )


def _ms(seconds: float) -> str:
    return "failed" if math.isinf(seconds) else f"{1000 * seconds:.1f}"


def table(results: Sequence[ModeResult]) -> str:
    """The modes side by side, one row each."""
    header = f"{'mode':<16} {'p50 ms':>8} {'p99 ms':>8} {'requests':>8} {'failed':>7} {'unlisted':>8} "
    header += f"{'slot loads':>10} {'op loads':>8} {'slots held':>10} {'configured':>10}"
    rows = [header]
    for r in results:
        rows.append(
            f"{r.mode:<16} {_ms(r.ttft_percentile(50)):>8} {_ms(r.ttft_percentile(99)):>8} {len(r.outcomes):>8} {r.failures:>7} "
            f"{r.unlisted:>8} {r.slot_loads:>10} {r.operator_loads:>8} {r.slots_held:>10} {r.slots_configured:>10}"
        )
    return "\n".join(rows)


def target_line(check: TargetCheck) -> str:
    """The target's verdict, with its two ratios."""
    verdict = "met" if check.met else "NOT met"
    return (
        f"target (scaling p99 <= 2x all-resident p99, with <= 1/4 of its slots): {verdict}: "
        f"p99 ratio {check.p99_ratio:.2f}, slot ratio {check.slot_ratio:.3f}"
    )


# ---- the fleet ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One way of holding the adapters: the agents' slots, and what each LoraAdapter's spec
    adds (``scaling``, ``replicas``, or nothing: every agent)."""

    name: str
    slots_per_agent: int
    spec: dict[str, Any]


@dataclass(frozen=True)
class Setup:
    """The run's sizes and where its files are."""

    agents: int
    slots_per_agent: int
    adapters: int
    model: Path
    adapter_root: Path
    logs: Path
    scale_down_window_s: int


def modes(setup: Setup) -> tuple[Mode, ...]:
    scaling = {
        "minReplicas": 0,
        "maxReplicas": setup.agents,
        "target": {"metric": "Requests", "perReplica": 1},
        "behavior": {
            "scaleDown": {"stabilizationWindowSeconds": setup.scale_down_window_s},
            "scaleUp": {"replicas": setup.agents, "periodSeconds": 1},
        },
    }
    return (
        Mode("scaling", setup.slots_per_agent, {"scaling": scaling}),
        Mode("fixed replicas", setup.slots_per_agent, {"replicas": 1}),
        Mode("all resident", setup.adapters, {}),
    )


def adapter_name(index: int) -> str:
    return f"a{index:03d}"


def adapter_manifest(index: int, setup: Setup, mode: Mode) -> dict[str, Any]:
    name = adapter_name(index)
    return {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraAdapter",
        "metadata": {"name": name},
        "spec": {
            "baseModel": BASE_MODEL,
            "source": {"uri": f"file://{setup.adapter_root / name}"},
            "fleetRef": {"name": "default"},
            **mode.spec,
        },
    }


@dataclass(frozen=True)
class Fleet:
    """One mode's running fleet: agents (name -> process, HTTP port), namespace, operator."""

    cluster: ControlPlane
    namespace: str
    agents: dict[str, AgentProcess]
    http_ports: dict[str, int]
    operator_metrics_port: int


def _apply(cluster: ControlPlane, ns: str, items: Sequence[dict[str, Any]]) -> None:
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(items)}), ns)


HTTP_PORT_TRIES = 3


def start_agent(name: str, spec: AgentSpec, log_dir: Path) -> tuple[AgentProcess, int]:
    """Start one agent with its HTTP API on a free port and wait until it serves; a start that
    lost that port to another program meanwhile (the machine is shared) is tried again on a new
    one, at most :data:`HTTP_PORT_TRIES` times. Returns the agent and its HTTP port."""
    attempt = 1
    while True:
        port = free_port()
        agent = AgentProcess(name, replace(spec, extra_args=("--http-listen", f"{spec.host}:{port}")), log_dir).start()
        try:
            return agent.wait_ready(timeout_s=600), port  # the shared machine can be slow to start one
        except RuntimeError as err:
            agent.stop()
            if "(--http-listen)" not in str(err) or attempt >= HTTP_PORT_TRIES:
                raise
            attempt += 1


@contextmanager
def fleet(cluster: ControlPlane, setup: Setup, mode: Mode) -> Iterator[Fleet]:
    """Fresh agents with the mode's slots, their pods, the fleet and the operator in a new
    namespace; all stopped on the way out."""
    host = machine_ip()  # EndpointSlices refuse loopback addresses
    spec = AgentSpec(setup.model, (setup.adapter_root,), BASE_MODEL, tp=1, dp=1, max_loaded_loras=mode.slots_per_agent, host=host)
    log_dir = setup.logs / mode.name.replace(" ", "-")
    agents: dict[str, AgentProcess] = {}
    http_ports: dict[str, int] = {}
    ns = cluster.create_namespace(prefix="bench")
    operator = None
    try:
        for name in (f"agent-{i}" for i in range(setup.agents)):
            agents[name], http_ports[name] = start_agent(name, spec, log_dir)
            labels = {FLEET_LABEL: "default"}
            cluster.create_agent_pod(ns, name, agents[name].port, labels=labels, ip=host, http_port=http_ports[name])
        fleet_spec = {"selector": {"matchLabels": {FLEET_LABEL: "default"}}, "grpcPortName": "grpc"}
        _apply(
            cluster,
            ns,
            [{"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraFleet", "metadata": {"name": "default"}, "spec": fleet_spec}],
        )
        metrics_port = free_port()
        operator = _start_operator(cluster, ns, metrics_port, log_dir / "operator.log")
        yield Fleet(cluster, ns, agents, http_ports, metrics_port)
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(30)
        for agent in agents.values():
            agent.stop()
        cluster.delete_namespace(ns)


def _start_operator(cluster: ControlPlane, ns: str, metrics_port: int, log_path: Path) -> subprocess.Popen[bytes]:
    env = {
        **cluster.tool_env(),
        **OPERATOR_ENV,
        "LORAFLEET_WATCH_NAMESPACES": ns,
        "LORAFLEET_LEASE_NAMESPACE": ns,
        "LORAFLEET_METRICS_PORT": str(metrics_port),
        "POD_NAME": "bench-operator",
    }
    with open(log_path, "wb") as out:
        return subprocess.Popen(["lorafleet-operator"], stdout=out, stderr=subprocess.STDOUT, env=env)


# ---- reading the fleet ----------------------------------------------------------------------


def prometheus_samples(url: str) -> dict[str, float]:
    """A Prometheus endpoint's samples, "name{labels}" -> value."""
    samples = {}
    for line in requests.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def slot_loads(fleet_: Fleet) -> int:
    """Standby adapters loaded onto the ranks so far, summed over the agents."""
    total = 0.0
    for agent in fleet_.agents.values():
        total += prometheus_samples(f"http://{agent.spec.host}:{agent.metrics_port}/metrics").get(
            "vllm:lora_adapter_load_seconds_count", 0.0
        )
    return int(total)


def operator_loads(fleet_: Fleet) -> int:
    """LoadAdapter calls the operator made so far, whatever their outcome."""
    samples = prometheus_samples(f"http://127.0.0.1:{fleet_.operator_metrics_port}/metrics")
    return int(sum(v for k, v in samples.items() if k.startswith("lorafleet_agent_calls_total{") and 'method="LoadAdapter' in k))


def resident_count(agent: AgentProcess) -> int:
    """Adapters resident on the agent now (ListAdapters)."""
    with grpc.insecure_channel(agent.endpoint) as channel:
        reply = agent_pb2_grpc.NodeAgentStub(channel).ListAdapters(agent_pb2.ListAdaptersRequest(), timeout=10)
    return sum(a.residency == RESIDENT for a in reply.adapters)


class Periodic:
    """A context that calls :meth:`tick` on entry, then every ``interval_s`` on a thread of its
    own, and once more on exit."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.tick()
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join()
        self.tick()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.tick()


class Routes(Periodic):
    """Each adapter's routed pods (name -> [pod]), from its EndpointSlices in the namespace,
    read every second while the context is open."""

    def __init__(self, fleet_: Fleet) -> None:
        super().__init__(1.0)
        self.fleet = fleet_
        self.lock = threading.Lock()
        self.routed: dict[str, list[str]] = {}

    def tick(self) -> None:
        code, body = self.fleet.cluster.request("GET", f"/apis/discovery.k8s.io/v1/namespaces/{self.fleet.namespace}/endpointslices")
        if code != 200:
            log.warning("listing EndpointSlices: %s %s", code, body)
            return
        routed: dict[str, list[str]] = {}
        for item in body.get("items") or []:
            adapter = ((item.get("metadata") or {}).get("annotations") or {}).get(ADAPTER_ANNOTATION)
            if adapter is None:
                continue
            pods = [e["targetRef"]["name"] for e in item.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")]
            routed.setdefault(adapter, []).extend(pods)
        with self.lock:
            self.routed = routed

    def pods(self, adapter: str) -> list[str]:
        with self.lock:
            return list(self.routed.get(adapter, []))


class SlotSampler(Periodic):
    """The most adapters resident over the agents at once, sampled every half second."""

    def __init__(self, agents: Sequence[AgentProcess]) -> None:
        super().__init__(0.5)
        self.agents = agents
        self.peak = 0

    def tick(self) -> None:
        self.peak = max(self.peak, sum(resident_count(a) for a in self.agents))


# ---- one mode -------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> bool:
    """Poll until true; False (logged) at the timeout, for the caller to go on with what it has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    log.warning("gave up waiting for %s after %.0f s", what, timeout_s)
    return False


def phases(fleet_: Fleet) -> list[str]:
    items = fleet_.cluster.kubectl_json("get", "la", "-n", fleet_.namespace)["items"]
    return [str((i.get("status") or {}).get("phase", "")) for i in items]


def settle(fleet_: Fleet, routes: Routes, setup: Setup, mode: Mode) -> None:
    """Wait until the adapters are placed as the mode can place them: every one Ready (the
    fixed mode: as many as there are slots) and routed, then two seconds more."""
    ready_wanted = min(setup.adapters, setup.agents * mode.slots_per_agent) if "replicas" in mode.spec else setup.adapters
    wait_until(lambda: phases(fleet_).count("Ready") >= ready_wanted, 300, f"{ready_wanted} adapters Ready ({mode.name})")
    wait_until(lambda: sum(bool(routes.pods(adapter_name(i))) for i in range(setup.adapters)) >= ready_wanted, 60, "the slices")
    time.sleep(2)


def send(fleet_: Fleet, routes: Routes, adapter: str, route: float) -> Outcome:
    """One streamed completion, routed as a gateway would; its TTFT measured here."""
    listed = routes.pods(adapter)
    pod = pick(route, listed or list(fleet_.agents))
    url = f"http://{fleet_.agents[pod].spec.host}:{fleet_.http_ports[pod]}/v1/completions"
    body: dict[str, Any] = {
        "model": f"{fleet_.namespace}.{adapter}",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "temperature": 0,
    }
    started = time.perf_counter()
    ttft = None
    try:
        with requests.post(url, json=body, stream=True, timeout=120) as resp:
            if resp.status_code != 200:
                return Outcome(None, f"{resp.status_code} {resp.text[:200]}", bool(listed))
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                if b'"error"' in line:
                    return Outcome(None, line.decode(errors="replace")[:200], bool(listed))
                ttft = time.perf_counter() - started if ttft is None else ttft
    except requests.RequestException as err:
        return Outcome(None, str(err)[:200], bool(listed))
    return Outcome(ttft, "" if ttft is not None else "no token", bool(listed))


def replay(fleet_: Fleet, routes: Routes, trace: Sequence[TraceRequest]) -> tuple[Outcome, ...]:
    """Send the trace open-loop: each request at its time, whatever the others are doing."""
    with ThreadPoolExecutor(max_workers=64) as pool:
        started = time.perf_counter()
        futures = []
        for request in trace:
            time.sleep(max(0.0, started + request.at_s - time.perf_counter()))
            futures.append(pool.submit(send, fleet_, routes, adapter_name(request.adapter), request.route))
        return tuple(f.result() for f in futures)


def run_mode(cluster: ControlPlane, setup: Setup, mode: Mode, trace: Sequence[TraceRequest]) -> ModeResult:
    """Place the adapters as the mode says, then replay the trace and measure."""
    with fleet(cluster, setup, mode) as fleet_, Routes(fleet_) as routes:
        _apply(cluster, fleet_.namespace, [adapter_manifest(i, setup, mode) for i in range(setup.adapters)])
        settle(fleet_, routes, setup, mode)
        loads_before, op_before = slot_loads(fleet_), operator_loads(fleet_)
        with SlotSampler(list(fleet_.agents.values())) as sampler:
            outcomes = replay(fleet_, routes, trace)
        result = ModeResult(
            mode=mode.name,
            outcomes=outcomes,
            slot_loads=slot_loads(fleet_) - loads_before,
            operator_loads=operator_loads(fleet_) - op_before,
            slots_held=sampler.peak,
            slots_configured=mode.slots_per_agent * setup.agents,
        )
    errors = sorted({o.error for o in outcomes if o.error})
    log.info("%s: %d failed; errors seen: %s", mode.name, result.failures, errors[:5])
    return result


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run: 2 slots per agent, 100 requests")
    parser.add_argument("--agents", type=int, default=2, help="agents in the fleet (default 2)")
    parser.add_argument("--slots", type=int, default=None, help="slots per agent in the scaling and fixed modes (default 4; --quick 2)")
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace (default 400; --quick 100)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second, Poisson (default 2)")
    parser.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent of adapter popularity (default 1.1)")
    parser.add_argument("--window", type=int, default=30, help="the scaling mode's scale-down window, seconds (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    parser.add_argument("--reverse", action="store_true", help="run the modes in reverse order (shows the machine's drift)")
    parser.add_argument("--logs", type=Path, default=None, help="keep the agents' and operators' logs here (default: deleted)")
    args = parser.parse_args(argv)
    args.slots = args.slots or (2 if args.quick else 4)
    args.requests = args.requests or (100 if args.quick else 400)
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    adapters = 4 * args.agents * args.slots
    trace = zipf_trace(adapters, args.requests, args.rate, args.zipf, args.seed)
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-ttft-") as tmp:
        root = Path(tmp)
        setup = Setup(
            args.agents,
            args.slots,
            adapters,
            write_model(root / "model", SHAPE),
            root / "adapters",
            args.logs or root / "logs",
            args.window,
        )
        for i in range(adapters):
            write_adapter(setup.adapter_root / adapter_name(i), SHAPE, rank=8, seed=i)
        cluster = ControlPlane.start(find_bin_dir(CHECKOUT))
        try:
            cluster.kubectl("apply", "--server-side", "-f", str(CHECKOUT.crds))
            cluster.kubectl(
                "wait", "--for=condition=Established", "--timeout=60s", "crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev"
            )
            order = modes(setup)[::-1] if args.reverse else modes(setup)
            measured = {mode.name: run_mode(cluster, setup, mode, trace) for mode in order}
        finally:
            cluster.stop()
    print(
        f"\n{args.agents} agents (tp=1, dp=1, CPU), {args.slots} slots each, {adapters} adapters, "
        f"{args.requests} requests at {args.rate:g}/s, Zipf {args.zipf:g}, seed {args.seed}:"
    )
    results = [measured[mode.name] for mode in modes(setup)]
    print(table(results))
    print(target_line(target_check(results[0], results[2])))


if __name__ == "__main__":
    main()
