"""The Gateway API Inference Extension's endpoint picker (EPP, v1.5.0, built by
``scripts/build-epp.sh``) as a local process against the local control plane, in front of local
node agents (docs/gateway.md).

The EPP watches one ``InferencePool`` and the Ready Pods its selector matches, and scrapes each
pod's ``/metrics`` at ``status.podIP:<targetPort>``. Local agents are no real pods: each listens
on an address of its own on this machine (:mod:`lorafleet_dev.addresses`; one HTTP port for all,
as the pool has one target port), and its Pod object, written by the stand-in kubelet, carries
that address as its IP. Requests reach the EPP through :mod:`lorafleet_dev.ext_proc`, standing
in for Envoy; :func:`adapter_slices` and :func:`subset_hint` are what a gateway reads of
lorafleet's EndpointSlices to send the EPP a subset hint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet_dev.controlplane import ControlPlane
from lorafleet_dev.processes import ChildProcess, built_bin_dir, free_port
from lorafleet_operator.routing import ADAPTER_LABEL, MANAGED_BY, MANAGED_BY_LABEL, adapter_label

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-epp.sh"
#: The CRDs the EPP reads, by name, and their files in the module: InferencePool, and the optional
#: ones it discovers at start-up (it logs an error for each one missing).
CRD_FILES = {
    "inferencepools.inference.networking.k8s.io": "inference.networking.k8s.io_inferencepools.yaml",
    "inferenceobjectives.inference.networking.x-k8s.io": "inference.networking.x-k8s.io_inferenceobjectives.yaml",
    "inferencemodelrewrites.inference.networking.x-k8s.io": "inference.networking.x-k8s.io_inferencemodelrewrites.yaml",
}
STARTUP_TIMEOUT_S = 120.0

#: The picker's plugins: the queue, KV-cache and LoRA-affinity scorers over the agents' ``vllm:*``
#: metrics (docs/http-api.md). lorafleet is an engine entry of its own, so nothing waits for a
#: metric it may not export (``vllm:cache_config_info`` only feeds prefix-cache tuning). The
#: weights are the ones measured in docs/gateway.md.
PICKER_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: lora-affinity-scorer
- type: metrics-data-source
  parameters: {scheme: http, path: /metrics}
- type: core-metrics-extractor
  parameters:
    defaultEngine: lorafleet
    engineConfigs:
    - name: lorafleet
      queuedRequestsSpec: "vllm:num_requests_waiting"
      runningRequestsSpec: "vllm:num_requests_running"
      kvUsageSpec: "vllm:kv_cache_usage_perc"
      loraSpec: "vllm:lora_requests_info"
      cacheInfoSpec: ""
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: lora-affinity-scorer, weight: 1}
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"""


@dataclass(frozen=True)
class EppBuild:
    """What ``scripts/build-epp.sh`` left in its cache."""

    bin_dir: Path

    @property
    def epp(self) -> Path:
        return self.bin_dir / "epp"

    @property
    def descriptors(self) -> Path:
        """envoy's ext_proc v3 service as a FileDescriptorSet (:mod:`lorafleet_dev.ext_proc`)."""
        return self.bin_dir.parent / "share" / "ext_proc_v3.binpb"

    @property
    def crds(self) -> Path:
        return self.bin_dir.parent / "crds"


def epp_build() -> EppBuild:
    """The built EPP (``LORAFLEET_EPP_BIN_DIR`` overrides); HarnessError naming the build script
    when it is not built (nothing is built here)."""
    return EppBuild(built_bin_dir(BUILD_SCRIPT, "LORAFLEET_EPP_BIN_DIR", ("epp",), "endpoint picker (GIE v1.5.0's EPP)", "about 3 minutes"))


def install_pool_crds(cluster: ControlPlane, build: EppBuild) -> None:
    """The CRDs of :data:`CRD_FILES` applied (server-side: again is harmless) and Established."""
    for file in CRD_FILES.values():
        cluster.kubectl("apply", "--server-side", "-f", str(build.crds / file))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{name}" for name in CRD_FILES))


@dataclass(frozen=True)
class PoolSpec:
    """One InferencePool: the pods its label selector matches, served on one target port."""

    namespace: str
    name: str
    selector: Mapping[str, str]
    target_port: int


def create_inference_pool(cluster: ControlPlane, pool: PoolSpec, picker_port: int) -> None:
    """Create the pool, its endpoint picker named as a Service on ``picker_port`` (the field is
    required; nothing here routes through that Service)."""
    manifest = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": pool.name, "namespace": pool.namespace},
        "spec": {
            "selector": {"matchLabels": dict(pool.selector)},
            "targetPorts": [{"number": pool.target_port}],
            "endpointPickerRef": {"name": f"{pool.name}-epp", "port": {"number": picker_port}},
        },
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(manifest))


@dataclass(frozen=True)
class EndpointView:
    """What the EPP last scraped from one endpoint (its ``Refreshed metrics`` trace line)."""

    pod: str
    running_adapters: frozenset[str]
    waiting_adapters: frozenset[str]
    max_adapters: int


_ENDPOINT_POD = re.compile(r"^(?P<pod>.+)-rank-\d+$")
# The extractor logs the endpoint's metrics struct as Go's %v prints it:
# "{ActiveModels:map[a:0 b:0] WaitingModels:map[] MaxActiveModels:2 ...}".
_MODELS = re.compile(r"\b(?P<field>ActiveModels|WaitingModels):map\[(?P<entries>[^\]]*)\]")
_MAX_MODELS = re.compile(r"\bMaxActiveModels:(?P<value>\d+)")


def _endpoint_view(line: str) -> EndpointView | None:
    """The view in one JSON log line of the EPP, or None if the line is another one."""
    if '"Refreshed metrics"' not in line:
        return None
    record: dict[str, Any] = json.loads(line)
    match = _ENDPOINT_POD.match(str(record.get("endpoint", {}).get("name", "")))
    updated = str(record.get("updated", ""))
    models = {m["field"]: frozenset(e.rpartition(":")[0] for e in m["entries"].split()) for m in _MODELS.finditer(updated)}
    max_models = _MAX_MODELS.search(updated)
    if match is None or max_models is None:
        return None
    return EndpointView(
        pod=match["pod"],
        running_adapters=models.get("ActiveModels", frozenset()),
        waiting_adapters=models.get("WaitingModels", frozenset()),
        max_adapters=int(max_models["value"]),
    )


@dataclass
class EppProcess:
    """One running EPP: its ext_proc (gRPC) address and its log."""

    process: ChildProcess
    grpc_port: int
    health_port: int
    metrics_port: int
    _read: int = 0  # how much of the log `views` has read
    _views: dict[str, EndpointView] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """Where Envoy (or :class:`lorafleet_dev.ext_proc.ExtProcClient`) talks ext_proc."""
        return f"127.0.0.1:{self.grpc_port}"

    def serving(self) -> bool:
        """Whether its gRPC health check says SERVING (the pool is synced)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def views(self) -> dict[str, EndpointView]:
        """Per pod, the metrics the EPP scraped last (from its trace log, read on from where the
        last call stopped: whole lines only)."""
        with self.process.log_path.open("rb") as log_file:
            log_file.seek(self._read)
            chunk = log_file.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._read += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            view = _endpoint_view(line) if line.startswith("{") else None
            if view is not None:
                self._views[view.pod] = view
        return dict(self._views)

    def wait_for_view(self, what: str, seen: Callable[[dict[str, EndpointView]], bool], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until the EPP's scraped metrics satisfy ``seen`` (HarnessError with its log tail
        if it exits or the time runs out)."""
        self.process.wait_until(what, lambda: seen(self.views()), timeout_s)

    def stop(self) -> None:
        self.process.stop()


def start_epp(cluster: ControlPlane, build: EppBuild, pool: PoolSpec, log_dir: Path) -> EppProcess:
    """Start the EPP for ``pool`` (insecure, no tracing, scraping every 200 ms: the shared test
    machine's pace) with :data:`PICKER_CONFIG`, logging every scrape (JSON, trace level) so a
    test can see what it knows; returns once its health check says SERVING."""
    config = log_dir / "epp-config.yaml"
    config.write_text(PICKER_CONFIG)
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    argv = [
        str(build.epp),
        f"--pool-name={pool.name}",
        f"--pool-namespace={pool.namespace}",
        f"--grpc-port={grpc_port}",
        f"--grpc-health-port={health_port}",
        f"--metrics-port={metrics_port}",
        f"--config-file={config}",
        "--secure-serving=false",
        "--metrics-endpoint-auth=false",
        "--tracing=false",
        "--enable-pprof=false",
        "--refresh-metrics-interval=200ms",
        "--metrics-staleness-threshold=2s",
        "--zap-encoder=json",
        "--v=5",
    ]
    process = ChildProcess.spawn("epp", argv, log_dir, env={**cluster.tool_env(), "KUBECONFIG": str(cluster.kubeconfig)})
    epp = EppProcess(process, grpc_port, health_port, metrics_port)
    try:
        process.wait_until("the EPP's health check", epp.serving, STARTUP_TIMEOUT_S)
    except BaseException:
        epp.stop()
        raise
    return epp


def adapter_slices(cluster: ControlPlane, namespace: str, adapter: str) -> list[dict[str, Any]]:
    """The EndpointSlices the operator wrote for one LoraAdapter (by its resource name), as the
    API server holds them: those labelled with the adapter and with lorafleet's managed-by value
    (docs/operator.md, "Routing trust": a gateway routes by no other)."""
    selector = f"{ADAPTER_LABEL}={adapter_label(adapter)},{MANAGED_BY_LABEL}={MANAGED_BY}"
    return list(cluster.kubectl_json("get", "endpointslices", "-n", namespace, "-l", selector)["items"])


def subset_hint(slices: Sequence[Mapping[str, Any]], port_name: str = "http") -> tuple[str, ...]:
    """The gateway's subset hint for one adapter: ``ip:port`` of every ready endpoint of its
    EndpointSlices (the union, as docs/operator.md's Routing says readers take it), with the
    slice's port named ``port_name``."""
    hint = []
    for slice_ in slices:
        ports = {p.get("name"): p.get("port") for p in slice_.get("ports") or ()}
        if port_name not in ports:
            continue
        for endpoint in slice_.get("endpoints") or ():
            if endpoint.get("conditions", {}).get("ready", True):
                hint += [f"{address}:{ports[port_name]}" for address in endpoint.get("addresses", ())]
    return tuple(sorted(set(hint)))
