"""Operator benchmark: time from `kubectl apply` to Ready for 1 and for 100
LoraAdapters on a fleet of 4 node agents (tp=2, dp=2 on the CPU, tiny generated model), printed
side by side from one run.

Everything is real: the control plane (lorafleet_dev.controlplane), `lorafleet-agent serve`
processes, the `lorafleet-operator` process. "Ready" is read from the API server (every
adapter's status.phase == Ready, i.e. every rank of every agent holds it), polled every
0.2 s, so figures are rounded up by up to that much.

Run: `. scripts/bootstrap.sh && python benchmarks/bench_operator.py [--repeats N]`.
CPU timings on a shared, noisy 2-core machine (4 agents = 12 processes): read the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from lorafleet_dev.agents import AgentSpec, start_agents
from lorafleet_dev.checkout import Checkout
from lorafleet_dev.controlplane import ControlPlane, find_bin_dir
from lorafleet_dev.processes import free_port
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model

log = logging.getLogger("bench_operator")
CHECKOUT = Checkout.at(Path(__file__).resolve().parents[1])
SHAPE = SyntheticModel()
AGENTS = 4


def adapter(name: str, path: Path) -> dict[str, object]:
    return {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraAdapter",
        "metadata": {"name": name},
        "spec": {"baseModel": "tiny", "source": {"uri": f"file://{path}"}, "fleetRef": {"name": "default"}},
    }


def apply_and_wait(cluster: ControlPlane, ns: str, paths: dict[str, Path], timeout_s: float = 900) -> float:
    """Seconds from the apply of these adapters (one request) until all of them are Ready."""
    manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": [adapter(n, p) for n, p in paths.items()]})
    started = time.perf_counter()
    cluster.apply(manifest, ns)
    while True:
        items = cluster.kubectl_json("get", "la", "-n", ns)["items"]
        ready = sum((i.get("status") or {}).get("phase") == "Ready" for i in items)
        if ready == len(paths):
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"only {ready}/{len(paths)} Ready after {timeout_s}s")
        time.sleep(0.2)


def delete_all(cluster: ControlPlane, ns: str) -> None:
    cluster.kubectl("delete", "la", "--all", "-n", ns, "--wait=true", "--timeout=600s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each size (median)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 100])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        root = Path(tmp)
        model = write_model(root / "model", SHAPE)
        adapters = root / "adapters"
        paths = {f"a{i:03d}": write_adapter(adapters / f"a{i:03d}", SHAPE, rank=8, seed=i) for i in range(max(args.sizes))}
        cluster = ControlPlane.start(find_bin_dir(CHECKOUT))
        agents = []
        operator = None
        try:
            cluster.kubectl("apply", "--server-side", "-f", str(CHECKOUT.crds))
            cluster.kubectl(
                "wait", "--for=condition=Established", "--timeout=60s", "crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev"
            )
            spec = AgentSpec(model_dir=model, adapter_roots=(adapters,), base_model_name="tiny", max_loaded_loras=max(args.sizes) + 8)
            agents = start_agents([f"agent-{i}" for i in range(AGENTS)], spec, root / "logs")
            ns = cluster.create_namespace("bench")
            for agent in agents:
                cluster.create_agent_pod(ns, agent.name, agent.port)
            cluster.apply(
                json.dumps(
                    {
                        "apiVersion": "lorafleet.dev/v1alpha1",
                        "kind": "LoraFleet",
                        "metadata": {"name": "default"},
                        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "lorafleet-agent"}}},
                    }
                ),
                ns,
            )
            env = {
                **cluster.tool_env(),
                "LORAFLEET_WATCH_NAMESPACES": ns,
                "LORAFLEET_LEASE_NAMESPACE": ns,
                "LORAFLEET_METRICS_PORT": str(free_port()),
                "LORAFLEET_LOG_LEVEL": "WARNING",
            }
            with open(root / "operator.log", "wb") as out:
                operator = subprocess.Popen(["lorafleet-operator"], stdout=out, stderr=subprocess.STDOUT, env=env)
            # Warm-up: the operator's start (leader election, first watch) is not measured.
            apply_and_wait(cluster, ns, dict(list(paths.items())[:1]))
            delete_all(cluster, ns)
            results: dict[int, list[float]] = {n: [] for n in args.sizes}
            for _ in range(args.repeats):
                for n in args.sizes:
                    chosen = dict(list(paths.items())[:n])
                    results[n].append(apply_and_wait(cluster, ns, chosen))
                    log.info("%3d adapters: %.2fs", n, results[n][-1])
                    delete_all(cluster, ns)
        finally:
            if operator is not None:
                operator.terminate()
                operator.wait(30)
            for agent in agents:
                agent.stop()
            cluster.stop()
    base = statistics.median(results[args.sizes[0]])
    print(f"\napply -> Ready on {AGENTS} agents (tp=2, dp=2, CPU), median of {args.repeats}:")
    print(f"{'adapters':>9} {'seconds':>9} {'per adapter (ms)':>17} {'vs first':>9}")
    for n in args.sizes:
        median = statistics.median(results[n])
        print(f"{n:>9} {median:>9.2f} {1000 * median / n:>17.1f} {median / base:>8.1f}x")


if __name__ == "__main__":
    main()
