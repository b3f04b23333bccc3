"""Fleet-scale benchmark: 1,000 LoraAdapters on 64 agents, the real control plane and
the real operator against SIMULATED agents, printed side by side from one run.

The agents are simulated (lorafleet_dev.simagents): one load-generator process serving 64 gRPC
endpoints, each the real ``lorafleet.v1.NodeAgent`` server over the real agent and registry
(validation, per-name locks), over a simulated backend behind the agent's seam: in-process ranks
that hold no weights, one command at a time, their replies merged failure-first and a partial
load rolled back by the functions the engine's driver uses. Only this benchmark uses them. The control plane
(lorafleet_dev.controlplane) and the ``lorafleet-operator`` process are real; the agents' Pods
are stand-ins (lorafleet_dev.kubelet) pointing at the simulated endpoints on 127.0.0.1, an
address the API server refuses in EndpointSlices: each adapter's slice lists no pod here, where a
real fleet's lists the pods holding it (docs/operator.md says what that leaves out).

Cases: ``replicas`` unset (every agent holds every adapter: 64,000 loads) and ``replicas: 4``;
each with every agent healthy, then with 10% of the agents (6 of 64) refusing every load on one
rank. Reported per case: seconds from the apply (one `kubectl apply`; the phases followed by
one watch) until every adapter has settled
(Ready when all agents are healthy; Ready, Degraded or Failed with failing agents), the
operator's CPU seconds and peak RSS over the case, its load calls while applying (the loads
waiting for one agent go together in one LoadAdapters call, up to LORAFLEET_LOAD_BATCH;
LoadAdapter carries one), API requests per adapter (the API server's
``apiserver_request_total``, less the benchmark's own requests), the largest LoraAdapter object
as stored (managedFields included), with failing agents the requests per adapter in a further
quiet window (a hot loop shows there), the phases at its end and when every adapter was first
Ready, if within it (an adapter first placed on agents that refuse it is placed again on
others: with ``replicas`` by the same reconcile, without by the next drift check), and the
deletion of every adapter that ends the case (one DELETE of the collection): seconds until all
are gone, the operator's peak RSS during it alone (its VmHWM reset first) and the UnloadAdapter
calls it made (its ``lorafleet_agent_calls_total``; a deletion unloads only from agents that
may hold the adapter: about replicas x adapters, where every agent was asked before, 64,000
for 1,000 adapters x 64 agents whatever the replicas); and per case the requests per adapter by
verb and resource (applying, deleting) and the CPU seconds of the operator, the simulator, the
API server and etcd over apply and deletion, how long the apply command itself took (the last
adapter cannot be Ready before its object exists) and kubectl's CPU for it. ``--unset-only``,
``--placed-only`` and ``--fleets`` pick cases. Targets: all Ready ≤ 60 s, operator RSS ≤ 500 MiB,
status ≤ 256 KiB, no hot loop.

The apply is ``kubectl apply`` (client-side: a GET and a POST per object, one object at a time)
unless ``--server-side`` (one PATCH per object); ``--go-gc`` sets GOGC for etcd and
kube-apiserver. Both change only the benchmark's own environment, not the operator: with two
cores, kubectl's request-by-request apply and the API server's garbage collection take time and
CPU from what is measured (the operator fleet-scale runs in benchmarks/results/).

Run: `. scripts/bootstrap.sh && python benchmarks/bench_fleet_scale.py [--adapters N] [--agents N] [--placed-only]
[--server-side] [--go-gc PERCENT]`. On a shared, noisy 2-core machine the simulator, etcd, the API
server and the operator share two cores: read the figures as an upper bound of what the
operator needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from lorafleet_dev.checkout import Checkout
from lorafleet_dev.controlplane import ControlPlane, KubectlError, find_bin_dir
from lorafleet_dev.processes import free_port
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model

log = logging.getLogger("bench_fleet_scale")
CHECKOUT = Checkout.at(Path(__file__).resolve().parents[1])
SHAPE = SyntheticModel()
POLL_S = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
# With failing agents an adapter cannot be Ready everywhere: it has settled once its phase says
# what every agent answered.
SETTLED = ("Ready", "Degraded", "Failed")
#: The operator's load methods (its ``lorafleet_agent_calls_total``), counted while applying.
LOAD_METHODS = ("LoadAdapter", "LoadAdapters")


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended (the kubectl commands)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CaseResult:
    """What one case measured."""

    name: str
    settled_s: float
    phases: dict[str, int]
    cpu_s: float
    peak_rss_mib: float
    requests_per_adapter: float
    largest_object_kib: float
    quiet_requests_per_adapter: float | None
    #: The phases at the end of the quiet window (None without one).
    quiet_phases: dict[str, int] | None
    #: Seconds from the apply until every adapter was Ready, watched until the quiet window
    #: ends (None: not by then).
    all_ready_s: float | None
    #: Deleting every adapter (one request): seconds until all are gone, the operator's peak
    #: RSS during the deletion alone, and the UnloadAdapter calls it made meanwhile.
    deleted_s: float
    delete_peak_rss_mib: float
    unloads: int
    #: API requests per adapter by (verb, resource, subresource), applying and deleting (the
    #: benchmark's own included: its apply's POST and GET, its watch and metric reads).
    requests_applying: dict[str, float]
    requests_deleting: dict[str, float]
    #: CPU seconds of the operator, the simulated agents, the API server and etcd over the
    #: apply and the deletion together.
    cpu_all_s: dict[str, float]
    #: The same from the apply until settled, and kubectl's for the apply ("kubectl apply"): what
    #: bounds "all Ready" on a machine whose cores they all share.
    cpu_applying_s: dict[str, float]
    #: The operator's load calls while applying, by method (LoadAdapter: one load each;
    #: LoadAdapters: the loads waiting for one agent together).
    load_calls: dict[str, int]
    #: How long the apply command itself took (kubectl creating the 1,000 objects): the last
    #: adapter cannot be Ready before its object exists.
    apply_s: float


def adapter_manifest(name: str, path: Path, replicas: int | None) -> dict[str, object]:
    spec: dict[str, object] = {"baseModel": "tiny", "source": {"uri": f"file://{path}"}, "fleetRef": {"name": "default"}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraAdapter", "metadata": {"name": name}, "spec": spec}


def request_counts(cluster: ControlPlane) -> dict[str, float]:
    """The requests the API server has counted since it started, by "VERB resource[/subresource]"
    (its ``apiserver_request_total``, summed over codes, scopes and components)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    counts: dict[str, float] = {}
    for match in re.finditer(r"^apiserver_request_total\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        key = f"{labels.get('verb', '?')} {labels.get('resource', '?')}"
        if labels.get("subresource"):
            key += f"/{labels['subresource']}"
        counts[key] = counts.get(key, 0.0) + float(match.group(2))
    return counts


def per_adapter(before: dict[str, float], after: dict[str, float], adapters: int) -> dict[str, float]:
    """The requests between two :func:`request_counts`, per adapter, largest first (kinds under
    0.01 per adapter left out)."""
    diff = {k: (v - before.get(k, 0.0)) / adapters for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in diff.items() if v >= 0.01), key=lambda kv: -kv[1]))


def component_pids(cluster: ControlPlane) -> dict[str, int]:
    """The API server's and etcd's process ids (by their command lines)."""
    found: dict[str, int] = {}
    for pid in cluster.pids:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        for name in ("kube-apiserver", "etcd"):
            if command.endswith(f"/{name}"):
                found[name] = pid
    return found


def operator_calls(metrics_port: int, method: str) -> float:
    """The operator's gRPC calls of ``method`` to agents so far, whatever their outcome."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    pattern = rf'^lorafleet_agent_calls_total\{{[^}}]*method="{method}"[^}}]*\}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def reset_peak_rss(pid: int) -> None:
    """Start the process's peak RSS (VmHWM) afresh from its current RSS (proc(5): clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PhaseWatch:
    """Every LoraAdapter's phase in one namespace, as one watch of the API server reports it
    (a thread; a list first, then the watch from that list's resourceVersion, listed again
    when the watch is too old). A watch, not a poll: listing 1,000 adapters each second costs
    the API server about 0.1 s of CPU per list, which would be a large share of what the
    benchmark measures. ``requests`` counts the lists and watches it made."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(kubeconfig)))
        self.namespace = namespace
        self.requests = 0
        self._phases: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, name="phase-watch", daemon=True)
        self._thread.start()

    def phases(self) -> dict[str, int]:
        """How many adapters are in each phase now ("" before a status is written)."""
        counts: dict[str, int] = {}
        with self._lock:
            for phase in self._phases.values():
                counts[phase] = counts.get(phase, 0) + 1
        return counts

    def close(self) -> None:
        """Stop watching (the thread ends with its watch's next event or end, within a minute)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._list_and_watch()
            except ApiException as err:
                if err.status != 410:  # 410 Gone: the resourceVersion is too old, list again
                    log.warning("phase watch: %s %s; again", err.status, err.reason)
                    time.sleep(1)
            except Exception as err:  # the connection broke: list and watch again
                log.warning("phase watch: %s; again", err)
                time.sleep(1)

    def _list_and_watch(self) -> None:
        args = ("lorafleet.dev", "v1alpha1", self.namespace, "loraadapters")
        self.requests += 1
        listed = _object(self.api.list_namespaced_custom_object(*args))
        with self._lock:
            self._phases = {item["metadata"]["name"]: _phase(item) for item in listed["items"]}
        self._watch = watch.Watch()
        self.requests += 1
        # The server ends each watch within a minute: then a fresh list (a closed watch's thread
        # ends by then too).
        for event in self._watch.stream(
            self.api.list_namespaced_custom_object, *args, timeout_seconds=60, resource_version=listed["metadata"]["resourceVersion"]
        ):
            item = event["object"]
            if event["type"] == "ERROR":
                raise ApiException(status=int(item.get("code", 0)), reason=str(item.get("reason", "")))
            name = item["metadata"]["name"]
            with self._lock:
                if event["type"] == "DELETED":
                    self._phases.pop(name, None)
                else:
                    self._phases[name] = _phase(item)
            if self._stop.is_set():
                return


def _object(answer: object) -> dict[str, Any]:
    """The client's answer as the JSON object it is (its custom-object calls are untyped)."""
    if not isinstance(answer, dict):
        raise TypeError(f"expected a JSON object, got {type(answer).__name__}")
    return answer


def _phase(item: dict[str, Any]) -> str:
    return str((item.get("status") or {}).get("phase", ""))


class Bench:
    """The control plane, the operator and a simulated fleet, and the cases run on them."""

    def __init__(self, root: Path, cluster: ControlPlane, agents: int, adapters: dict[str, Path], server_side: bool = False) -> None:
        self.root, self.cluster, self.agents, self.adapters = root, cluster, agents, adapters
        self.server_side = server_side  # apply with `kubectl apply --server-side`
        self.model = write_model(root / "model", SHAPE)
        self.ns = cluster.create_namespace("bench")
        self.fleet: subprocess.Popen[bytes] | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.polls = 0
        self.watch: PhaseWatch | None = None

    def start_fleet(self, failing: int) -> None:
        """(Re)start the simulated agents and their stand-in Pods."""
        self.stop_fleet()
        ports_file = self.root / f"ports-{failing}.json"
        with open(self.root / "simagents.log", "ab") as out:
            self.fleet = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lorafleet_dev.simagents",
                    "--model",
                    str(self.model),
                    "--adapter-root",
                    str(self.root / "adapters"),
                    "--base-model-name",
                    "tiny",
                    "--count",
                    str(self.agents),
                    "--failing",
                    str(failing),
                    "--ports-file",
                    str(ports_file),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 300
        while not ports_file.exists():
            if self.fleet.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulated agents did not start; see {self.root / 'simagents.log'}")
            time.sleep(0.2)
        ports = json.loads(ports_file.read_text())
        self.cluster.kubectl("delete", "pods", "--all", "-n", self.ns, "--grace-period=0", "--force", "--wait=true")
        for index, port in enumerate(ports):
            self.cluster.create_agent_pod(self.ns, f"sim-{index:02d}", port)

    def stop_fleet(self) -> None:
        if self.fleet is not None and self.fleet.poll() is None:
            self.fleet.send_signal(signal.SIGTERM)
            self.fleet.wait(60)
        self.fleet = None

    def start_operator(self) -> None:
        self.cluster.apply(
            json.dumps(
                {
                    "apiVersion": "lorafleet.dev/v1alpha1",
                    "kind": "LoraFleet",
                    "metadata": {"name": "default"},
                    "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "lorafleet-agent"}}},
                }
            ),
            self.ns,
        )
        self.metrics_port = free_port()
        env = {
            **self.cluster.tool_env(),
            "LORAFLEET_WATCH_NAMESPACES": self.ns,
            "LORAFLEET_LEASE_NAMESPACE": self.ns,
            "LORAFLEET_METRICS_PORT": str(self.metrics_port),
            "LORAFLEET_HEALTH_PORT": str(free_port()),
            "LORAFLEET_LOG_LEVEL": "WARNING",
        }
        with open(self.root / "operator.log", "ab") as out:
            self.operator = subprocess.Popen(["lorafleet-operator"], stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:  # its metrics answer: the load calls are counted from before the apply
            try:
                operator_calls(self.metrics_port, LOAD_METHODS[0])
                return
            except OSError:
                if self.operator.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the operator's metrics did not answer; see {self.root / 'operator.log'}") from None
                time.sleep(0.5)

    def stop_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(60)
            except subprocess.TimeoutExpired:
                log.warning("the operator did not exit within 60 s of SIGTERM; killed")
                self.operator.kill()
                self.operator.wait()

    def items(self) -> list[dict[str, Any]]:
        """The adapters as stored (kubectl leaves managedFields out unless asked)."""
        self.polls += 1
        return list(self.cluster.kubectl_json("get", "la", "-n", self.ns, "--show-managed-fields")["items"])

    def delete_all(self, timeout_s: float) -> None:
        """Delete every adapter with one request (DELETE of the collection), then wait until
        none is left. ``kubectl delete la --all`` deletes one object per request, a few per
        second, so the deletion time would measure kubectl rather than the operator. The API
        server may end the request at its 60-s request timeout while it goes on marking the
        objects (on a loaded machine): the DELETE is then sent again, as often as it takes
        (objects already being deleted are passed over)."""
        deadline = time.perf_counter() + timeout_s
        while True:
            try:
                self.cluster.kubectl("delete", "--raw", f"/apis/lorafleet.dev/v1alpha1/namespaces/{self.ns}/loraadapters")
                break
            except KubectlError as err:
                if time.perf_counter() > deadline:
                    raise
                log.warning("the collection DELETE ended early (%s); sent again", err.stderr.strip())
        assert self.watch is not None
        while sum(self.watch.phases().values()):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"adapters still there {timeout_s:.0f}s after their deletion")
            time.sleep(POLL_S)

    def run_case(self, name: str, replicas: int | None, failing: int, quiet_s: float, timeout_s: float) -> CaseResult:
        assert self.operator is not None
        log.info("case %s", name)
        manifest = json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": [adapter_manifest(n, p, replicas) for n, p in self.adapters.items()]}
        )
        self.watch = PhaseWatch(self.cluster.kubeconfig, self.ns)
        try:
            return self._run_case(name, manifest, failing, quiet_s, timeout_s)
        finally:
            self.watch.close()
            self.watch = None

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds so far of the operator, the simulated agents, the API server and etcd."""
        assert self.operator is not None and self.fleet is not None
        pids = {"operator": self.operator.pid, "simulator": self.fleet.pid, **component_pids(self.cluster)}
        return {name: process_cpu_s(pid) for name, pid in pids.items()}

    def _run_case(self, name: str, manifest: str, failing: int, quiet_s: float, timeout_s: float) -> CaseResult:
        assert self.operator is not None and self.watch is not None
        counts_before = request_counts(self.cluster)
        requests_before, polls_before = sum(counts_before.values()), self.polls + self.watch.requests
        cpu_all_before = self.cpu_now()
        cpu_before = cpu_all_before["operator"]
        calls_before = {m: operator_calls(self.metrics_port, m) for m in LOAD_METHODS}
        kubectl_before = children_cpu_s()
        started = time.perf_counter()
        self.cluster.apply(manifest, self.ns, *(("--server-side",) if self.server_side else ()))
        applied = time.perf_counter() - started
        kubectl_cpu = children_cpu_s() - kubectl_before
        phases = self.wait_settled(failing > 0, started, timeout_s)
        settled = time.perf_counter() - started
        cpu_applying = {k: v - cpu_all_before.get(k, 0.0) for k, v in self.cpu_now().items()}
        cpu_applying["kubectl apply"] = kubectl_cpu
        load_calls = {m: int(operator_calls(self.metrics_port, m) - calls_before[m]) for m in LOAD_METHODS}
        items = self.items()
        largest = max(len(json.dumps(item)) for item in items) / 1024
        own = self.polls + self.watch.requests - polls_before + 2  # the apply and the metrics read
        counts_settled = request_counts(self.cluster)
        requests = (sum(counts_settled.values()) - requests_before - own) / len(self.adapters)
        applying = per_adapter(counts_before, counts_settled, len(self.adapters))
        quiet, quiet_phases = None, None
        all_ready = settled if phases.get("Ready", 0) == len(self.adapters) else None
        if quiet_s:
            before, polls = sum(request_counts(self.cluster).values()), self.polls + self.watch.requests
            window_end = time.perf_counter() + quiet_s
            if all_ready is None:
                all_ready = self.first_all_ready(started, quiet_s)
            time.sleep(max(0.0, window_end - time.perf_counter()))
            own_quiet = self.polls + self.watch.requests - polls + 1  # and the metrics read
            quiet = (sum(request_counts(self.cluster).values()) - before - own_quiet) / len(self.adapters)
            quiet_phases = self.watch.phases()
        cpu_s, peak = process_cpu_s(self.operator.pid) - cpu_before, peak_rss_mib(self.operator.pid)
        reset_peak_rss(self.operator.pid)
        unloads_before = operator_calls(self.metrics_port, "UnloadAdapter")
        counts_deleting = request_counts(self.cluster)
        deleting = time.perf_counter()
        self.delete_all(1800)
        deleted = time.perf_counter() - deleting
        unloads = int(operator_calls(self.metrics_port, "UnloadAdapter") - unloads_before)
        deleting_requests = per_adapter(counts_deleting, request_counts(self.cluster), len(self.adapters))
        cpu_all = {k: v - cpu_all_before.get(k, 0.0) for k, v in self.cpu_now().items()}
        return CaseResult(
            name,
            settled,
            phases,
            cpu_s,
            peak,
            requests,
            largest,
            quiet,
            quiet_phases,
            all_ready,
            deleted,
            peak_rss_mib(self.operator.pid),
            unloads,
            applying,
            deleting_requests,
            cpu_all,
            cpu_applying,
            load_calls,
            applied,
        )

    def first_all_ready(self, started: float, window_s: float) -> float | None:
        """Seconds from ``started`` until every adapter is Ready, watched for ``window_s`` at
        most (None: not within it)."""
        assert self.watch is not None
        end = time.perf_counter() + window_s
        while time.perf_counter() < end:
            if self.watch.phases().get("Ready", 0) == len(self.adapters):
                return time.perf_counter() - started
            time.sleep(POLL_S)
        return None

    def wait_settled(self, failing: bool, started: float, timeout_s: float) -> dict[str, int]:
        while True:
            assert self.watch is not None
            phases = self.watch.phases()
            settled = (
                phases.get("Ready", 0) == len(self.adapters)
                if not failing
                else (sum(phases.get(phase, 0) for phase in SETTLED) == len(self.adapters))
            )
            if settled:
                return phases
            if time.perf_counter() - started > timeout_s:
                log.warning("not settled after %.0fs: %s", timeout_s, phases)
                return phases
            time.sleep(POLL_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=4, help="the placed case's spec.replicas")
    parser.add_argument("--quiet-s", type=float, default=30.0, help="window after settling, with failing agents")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up on a case after this long")
    parser.add_argument(
        "--placed-only",
        action="store_true",
        help="only the replicas N cases (replicas unset means adapters x agents loads: "
        "64,000 at the default size, minutes of the simulator's CPU)",
    )
    parser.add_argument("--unset-only", action="store_true", help="only the replicas-unset cases")
    parser.add_argument(
        "--fleets",
        choices=("both", "healthy", "failing"),
        default="both",
        help="the all-healthy fleet, the one with 10%% of its agents failing, or both in turn",
    )
    parser.add_argument(
        "--server-side",
        action="store_true",
        help="apply with `kubectl apply --server-side` (one PATCH per object) instead of the "
        "client-side apply (a GET and a POST per object, and a last-applied annotation)",
    )
    parser.add_argument(
        "--go-gc",
        type=int,
        default=None,
        metavar="PERCENT",
        help="GOGC of the control plane's etcd and kube-apiserver (default: Go's, 100). They "
        "share this machine's cores with the operator and the simulated agents: a larger "
        "value trades their memory for CPU",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failing = max(1, args.agents // 10)
    fleets = {"both": (0, failing), "healthy": (0,), "failing": (failing,)}[args.fleets]
    cases = (args.replicas,) if args.placed_only else (None,) if args.unset_only else (None, args.replicas)
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
        root = Path(tmp)
        adapters = {f"a{i:04d}": write_adapter(root / "adapters" / f"a{i:04d}", SHAPE, rank=8, seed=i) for i in range(args.adapters)}
        cluster = ControlPlane.start(find_bin_dir(CHECKOUT), go_gc=args.go_gc)
        bench = Bench(root, cluster, args.agents, adapters, args.server_side)
        try:
            cluster.kubectl("apply", "--server-side", "-f", str(CHECKOUT.crds))
            cluster.kubectl(
                "wait", "--for=condition=Established", "--timeout=60s", "crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev"
            )
            for fails in fleets:
                bench.start_fleet(fails)
                bench.start_operator()
                label = f"{fails} of {args.agents} agents failing"
                for replicas in cases:
                    case = f"replicas {'unset' if replicas is None else replicas}, {label}"
                    results.append(bench.run_case(case, replicas, fails, args.quiet_s if fails else 0.0, args.timeout_s))
                    log.info("%s", results[-1])
                bench.stop_operator()
        finally:
            bench.stop_operator()
            bench.stop_fleet()
            cluster.stop()
    print(
        f"\n{args.adapters} LoraAdapters on {args.agents} simulated agents (8 ranks each), real control plane "
        f"(GOGC {args.go_gc or 'default'}) and operator:"
    )
    print(
        f"{'case':<40}{'settled s':>10}{'op CPU s':>10}{'op RSS MiB':>11}{'req/adapter':>12}{'largest KiB':>12}"
        f"{'quiet req/ad':>13}{'delete s':>10}{'del RSS MiB':>12}{'unloads':>9}  phases"
    )
    for r in results:
        quiet = "" if r.quiet_requests_per_adapter is None else f"{r.quiet_requests_per_adapter:.2f}"
        print(
            f"{r.name:<40}{r.settled_s:>10.1f}{r.cpu_s:>10.1f}{r.peak_rss_mib:>11.0f}{r.requests_per_adapter:>12.1f}"
            f"{r.largest_object_kib:>12.1f}{quiet:>13}{r.deleted_s:>10.1f}{r.delete_peak_rss_mib:>12.0f}"
            f"{r.unloads:>9}  {r.phases}"
        )
    for r in results:
        print(f"\n{r.name}: the apply command took {r.apply_s:.1f} s ({'server' if args.server_side else 'client'}-side)")
        if r.quiet_phases is not None:
            ready = "not within it" if r.all_ready_s is None else f"at {r.all_ready_s:.1f} s"
            print(f"  phases at the end of the quiet window: {r.quiet_phases}; all Ready {ready}")
        print("  CPU s applying (until settled): " + ", ".join(f"{k} {v:.1f}" for k, v in r.cpu_applying_s.items()))
        print("  CPU s over apply and deletion: " + ", ".join(f"{k} {v:.1f}" for k, v in r.cpu_all_s.items()))
        print("  load calls applying: " + ", ".join(f"{k} {v}" for k, v in r.load_calls.items()))
        for what, counts in (("applying", r.requests_applying), ("deleting", r.requests_deleting)):
            print(f"  requests per adapter {what}: " + ", ".join(f"{k} {v:.2f}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
