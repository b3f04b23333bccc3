"""The control-plane harness itself: identity, RBAC, controllers, agent pods, clean shutdown."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

from lorafleet_dev.processes import port_block
from tests.kube.harness import CHECKOUT, ControlPlane, HarnessError, KubectlError, find_bin_dir, free_port


def test_free_ports_come_from_this_workers_block_outside_the_kernels_range() -> None:
    """A port chosen here and bound a moment later by a child cannot meanwhile be one the kernel
    handed to another socket (bind(0), an outgoing connection), nor one chosen again here."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(port in port_block() and not low <= port <= high for port in ports), (low, high, ports)


def test_free_port_passes_over_ports_in_use() -> None:
    first = free_port()
    held = []
    for port in range(first + 1, min(first + 4, port_block().stop)):
        listener = socket.socket()
        listener.bind(("127.0.0.1", port))
        listener.listen()
        held.append(listener)
    try:
        assert free_port() not in {listener.getsockname()[1] for listener in held}
    finally:
        for listener in held:
            listener.close()


def test_pytest_workers_and_other_processes_get_disjoint_port_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        blocks.append(set(port_block()))
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    blocks.append(set(port_block()))
    assert all(not a & b for i, a in enumerate(blocks) for b in blocks[i + 1 :])


def test_server_version_is_stamped(kube_cluster: ControlPlane) -> None:
    """/version must report the real version (not v0.0.0-master), matching the cache key."""
    version = kube_cluster.kubectl_json("version")
    server = version["serverVersion"]["gitVersion"]
    client = version["clientVersion"]["gitVersion"]
    assert re.fullmatch(r"v1\.\d+\.\d+", server), server
    assert client == server
    assert f"kube-{server}-" in str(kube_cluster.bin_dir)


def test_admin_is_cluster_admin_and_rbac_is_enforced(kube_cluster: ControlPlane) -> None:
    assert kube_cluster.kubectl("auth", "can-i", "*", "*").stdout.strip() == "yes"
    who = kube_cluster.kubectl_json("auth", "whoami")
    assert "system:masters" in who["status"]["userInfo"]["groups"]
    # An unknown user has nothing beyond discovery: RBAC is on.
    with pytest.raises(KubectlError) as err:
        kube_cluster.kubectl("get", "pods", "-n", "default", as_user="nobody")
    assert "forbidden" in err.value.stderr.lower()


def test_python_client_reads_the_kubeconfig(kube_cluster: ControlPlane) -> None:
    """The kubeconfig works for the official Python client too (what the operator uses)."""
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)))
    names = {ns.metadata.name for ns in api.list_namespace().items}
    assert {"default", "kube-system"} <= names


def test_agent_pod_looks_like_a_running_ready_pod(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    pod = kube_cluster.create_agent_pod(kube_namespace, "agent-0", 50123, labels={"lorafleet.dev/fleet": "default"})
    assert pod["status"]["podIP"] == "127.0.0.1"
    assert pod["status"]["phase"] == "Running"

    stored = kube_cluster.kubectl_json("get", "pod", "agent-0", "-n", kube_namespace)
    conditions = {c["type"]: c["status"] for c in stored["status"]["conditions"]}
    assert conditions["Ready"] == "True"
    assert conditions["ContainersReady"] == "True"
    (container,) = stored["status"]["containerStatuses"]
    assert container["ready"] is True and "running" in container["state"]
    (port,) = stored["spec"]["containers"][0]["ports"]
    assert (port["name"], port["containerPort"]) == ("grpc", 50123)
    assert stored["metadata"]["labels"]["app.kubernetes.io/name"] == "lorafleet-agent"

    # kubectl's own readiness logic agrees, and the selector an operator uses finds it.
    kube_cluster.kubectl("wait", "--for=condition=Ready", "pod/agent-0", "-n", kube_namespace, "--timeout=5s")
    found = kube_cluster.kubectl(
        "get",
        "pods",
        "-n",
        kube_namespace,
        "-l",
        "app.kubernetes.io/name=lorafleet-agent",
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.status.podIP}:{.spec.containers[0].ports[?(@.name=='grpc')].containerPort}{end}",
    ).stdout
    assert found == "agent-0 127.0.0.1:50123"


def test_agent_pod_readiness_restart_and_deletion(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    kube_cluster.create_agent_pod(kube_namespace, "agent-1", 50124, ready=False)
    pod = kube_cluster.kubectl_json("get", "pod", "agent-1", "-n", kube_namespace)
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "False"

    pod = kube_cluster.write_pod_status(kube_namespace, "agent-1", ready=True, restart_count=1)
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 1

    # Grace period 0: gone at once, no kubelet needed to confirm.
    kube_cluster.delete_pod(kube_namespace, "agent-1")
    assert kube_cluster.kubectl("get", "pod", "agent-1", "-n", kube_namespace, "--ignore-not-found", "-o", "name").stdout == ""


def test_namespace_deletion_and_garbage_collection(kube_cluster: ControlPlane) -> None:
    """The controller manager's namespace and garbage-collector controllers run."""
    ns = kube_cluster.create_namespace(prefix="gc")
    owner = kube_cluster.kubectl_json("create", "configmap", "owner", "-n", ns)
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "namespace": ns,
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}],
        },
    }
    kube_cluster.kubectl("create", "-f", "-", input=json.dumps(dependent))
    kube_cluster.create_agent_pod(ns, "agent-0", 50125)

    kube_cluster.kubectl("delete", "configmap", "owner", "-n", ns)
    kube_cluster.kubectl("wait", "--for=delete", "configmap/dependent", "-n", ns, "--timeout=60s")

    kube_cluster.delete_namespace(ns, wait=True)
    assert kube_cluster.kubectl("get", "namespace", ns, "--ignore-not-found", "-o", "name").stdout == ""


def test_start_and_stop_leave_no_processes(kube_bin_dir: Path) -> None:
    """A second, independent cluster (no controller manager) starts, serves and stops cleanly."""
    cluster = ControlPlane.start(kube_bin_dir, with_controller_manager=False)
    try:
        pids = cluster.pids
        assert len(pids) == 2
        # Without the controller manager the ServiceAccount admission plugin is off, so pods
        # can be created in a fresh namespace at once.
        ns = cluster.create_namespace()
        cluster.create_agent_pod(ns, "agent-0", 50126)
    finally:
        cluster.stop()
    deadline = time.monotonic() + 5
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    assert alive == []
    assert not cluster.work_dir.exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_missing_binaries_fail_with_instructions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAFLEET_KUBE_BIN_DIR", str(tmp_path))
    with pytest.raises(HarnessError, match=r"run scripts/build-kube\.sh"):
        find_bin_dir(CHECKOUT)
    monkeypatch.delenv("LORAFLEET_KUBE_BIN_DIR")
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path))
    with pytest.raises(HarnessError, match=r"run scripts/build-kube\.sh"):
        find_bin_dir(CHECKOUT)


def _gogc(pid: int) -> str | None:
    """The GOGC in a process's environment (None when it has none)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"GOGC=")), None)


def test_restart_apiserver_keeps_objects(kube_bin_dir: Path) -> None:
    """restart_apiserver() (a fault for operator tests) brings the same server back with data,
    and with the environment it started with (``go_gc``: GOGC of etcd and kube-apiserver)."""
    cluster = ControlPlane.start(kube_bin_dir, with_controller_manager=False, go_gc=300)
    try:
        ns = cluster.create_namespace()
        before = cluster.pids
        assert [_gogc(pid) for pid in before] == ["300", "300"]
        cluster.restart_apiserver(downtime_s=0.5)
        assert cluster.pids != before and len(cluster.pids) == 2
        assert [_gogc(pid) for pid in cluster.pids] == ["300", "300"]
        assert cluster.kubectl("get", "namespace", ns, "-o", "name").stdout.strip() == f"namespace/{ns}"
    finally:
        cluster.stop()
