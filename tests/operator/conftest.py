"""Fixtures for the operator's tests: the real ``lorafleet-operator`` as a subprocess.

The operator runs exactly as in production (leader election, kopf, metrics endpoint), pointed
at the session's control plane, watching one test namespace, with short intervals. Its log and
Prometheus metrics are what tests read to see what it did (e.g. how many LoadAdapter calls).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.kube.harness import ControlPlane, free_port

#: Short intervals so drift repair and retries show within seconds.
FAST_ENV = {
    "LORAFLEET_DRIFT_INTERVAL_SECONDS": "1",
    "LORAFLEET_FAILED_RETRY_SECONDS": "4",
    "LORAFLEET_FAILED_RETRY_MAX_SECONDS": "60",
    "LORAFLEET_TRANSIENT_RETRY_SECONDS": "0.5",
    "LORAFLEET_TRANSIENT_RETRY_MAX_SECONDS": "2",
    "LORAFLEET_LEASE_DURATION_SECONDS": "3",
    "LORAFLEET_CALL_DEADLINE_SECONDS": "5",
    "LORAFLEET_LOAD_DEADLINE_SECONDS": "60",
    "LORAFLEET_DELETE_RETRIES": "2",
}


CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "lorafleet"


def service_account_kubeconfig(cluster: ControlPlane, ns: str, sa: str, path: Path) -> Path:
    """A kubeconfig holding a real token of the ServiceAccount (TokenRequest API)."""
    token = cluster.kubectl("create", "token", sa, "-n", ns, "--duration=1h").stdout.strip()
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": cluster.server, "certificate-authority": str(cluster.ca_file)}}],
                "users": [{"name": sa, "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": sa, "namespace": ns}}],
                "current-context": "c",
            }
        )
    )
    return path


@dataclass
class OperatorProcess:
    """One running ``lorafleet-operator``."""

    popen: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int
    identity: str
    extra: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """The operator's Prometheus samples, "name{labels}" -> value."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def agent_calls(self, method: str) -> float:
        """LoadAdapter (etc.) calls this operator made, whatever their outcome."""
        pattern = re.compile(rf'^lorafleet_agent_calls_total\{{.*method="{method}".*\}}$')
        return sum(v for k, v in self.metrics().items() if pattern.match(k))

    def drift_checks(self) -> float:
        """Completed drift checks (of every fleet): the operator's own clock, for tests that
        must see that a check ran after some change, rather than sleep and hope."""
        return self.metrics().get("lorafleet_drift_checks_total", 0.0)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def start_operator(
    cluster: ControlPlane,
    namespace: str,
    work_dir: Path,
    *,
    identity: str = "op-0",
    kubeconfig: Path | None = None,
    env: dict[str, str] | None = None,
    wait_leader: bool = True,
) -> OperatorProcess:
    """Start ``lorafleet-operator`` for ``namespace`` (its lease there too)."""
    port = free_port()
    log_path = work_dir / f"operator-{identity}.log"
    full_env = {
        **cluster.tool_env(),
        **FAST_ENV,
        "KUBECONFIG": str(kubeconfig or cluster.kubeconfig),
        "LORAFLEET_WATCH_NAMESPACES": namespace,
        "LORAFLEET_LEASE_NAMESPACE": namespace,
        "POD_NAME": identity,
        "LORAFLEET_METRICS_PORT": str(port),
        "LORAFLEET_LOG_LEVEL": "INFO",
        **(env or {}),
    }
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(["lorafleet-operator"], stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    proc = OperatorProcess(popen, log_path, port, identity)
    if wait_leader:
        wait_for(lambda: "became leader" in proc.log(), 60, f"operator {identity} to lead", proc)
    return proc


def wait_for(
    predicate: Callable[[], object], timeout_s: float, what: str, operator: OperatorProcess | None = None, interval_s: float = 0.2
) -> None:
    """Poll until ``predicate()`` is truthy; fail with the operator's log tail otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except Exception:
            pass
        if operator is not None and operator.popen.poll() is not None:
            pytest.fail(f"operator exited ({operator.popen.returncode}) while waiting for {what}:\n{operator.log()[-4000:]}")
        if time.monotonic() > deadline:
            tail = operator.log()[-4000:] if operator else ""
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}\n{tail}")
        time.sleep(interval_s)


@pytest.fixture
def operator(kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator watching this test's namespace; stopped (SIGTERM) afterwards."""
    proc = start_operator(kube_cluster, kube_namespace, tmp_path)
    try:
        yield proc
    finally:
        proc.stop()
        if os.environ.get("LORAFLEET_SHOW_OPERATOR_LOG"):
            print(proc.log())
