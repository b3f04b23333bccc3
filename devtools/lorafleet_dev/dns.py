"""The cluster DNS of a real node: CoreDNS (built by ``scripts/build-node.sh``) as a host process.

It serves ``cluster.local`` from the API server with CoreDNS's kubernetes plugin, as a cluster's
DNS add-on would, and forwards every other name to the machine's own resolver (what the pods
used before there was a cluster DNS). It listens on port 53 of the node's address only (the
``bind`` plugin), which pods reach through their bridge gateway and which the kubelet writes
into their ``resolv.conf`` (``clusterDNS``). It reads the cluster as a ServiceAccount of its
own, allowed to list and watch Services, EndpointSlices and Namespaces, not as the admin.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

from lorafleet_dev.checkout import Checkout
from lorafleet_dev.controlplane import ControlPlane
from lorafleet_dev.processes import ChildProcess, HarnessError, free_port

CLUSTER_DOMAIN = "cluster.local"
#: The ServiceAccount (in kube-system) and ClusterRole CoreDNS reads the cluster as.
ACCOUNT = "lorafleet-coredns"
ACCOUNT_NAMESPACE = "kube-system"
#: How long its token lasts: longer than any test session.
TOKEN_LIFETIME_S = 24 * 3600


def find_coredns_bin_dir(checkout: Checkout) -> Path:
    """The cached bin dir of build-node.sh's CoreDNS (``LORAFLEET_COREDNS_BIN_DIR`` overrides
    it); nothing is built here: a missing build is an error naming the script."""
    override = os.environ.get("LORAFLEET_COREDNS_BIN_DIR")
    if override:
        bin_dir = Path(override)
    else:
        proc = subprocess.run(
            ["bash", str(checkout.build_node_script), "--print-coredns-bin-dir", "--no-build"], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise HarnessError(
                f"CoreDNS is not built; run scripts/build-node.sh first (minutes cold, cached afterwards).\n{proc.stderr.strip()}"
            )
        bin_dir = Path(proc.stdout.strip())
    if not os.access(bin_dir / "coredns", os.X_OK):
        raise HarnessError(f"{bin_dir} lacks coredns; run scripts/build-node.sh to build it")
    return bin_dir


def reader_manifest() -> str:
    """CoreDNS's ServiceAccount and its read-only ClusterRole and binding: what the kubernetes
    plugin lists and watches (pods too only with ``pods verified``, which is not used)."""
    reads = ["list", "watch"]
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT, "namespace": ACCOUNT_NAMESPACE}},
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRole",
                    "metadata": {"name": ACCOUNT},
                    "rules": [
                        {"apiGroups": [""], "resources": ["services", "namespaces"], "verbs": reads},
                        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": reads},
                    ],
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": ACCOUNT},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ACCOUNT},
                    "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": ACCOUNT_NAMESPACE}],
                },
            ],
        }
    )


def write_reader_kubeconfig(cluster: ControlPlane, path: Path) -> None:
    """Create CoreDNS's ServiceAccount and role, and write a kubeconfig with a token of it."""
    cluster.apply(reader_manifest())
    status, reply = cluster.request(
        "POST",
        f"/api/v1/namespaces/{ACCOUNT_NAMESPACE}/serviceaccounts/{ACCOUNT}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": TOKEN_LIFETIME_S}},
    )
    if status != 201 or not isinstance(reply, dict):
        raise HarnessError(f"TokenRequest for {ACCOUNT_NAMESPACE}/{ACCOUNT} failed ({status}): {reply}")
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "cluster", "cluster": {"server": cluster.server, "certificate-authority": str(cluster.ca_file)}}],
                "users": [{"name": ACCOUNT, "user": {"token": reply["status"]["token"]}}],
                "contexts": [{"name": ACCOUNT, "context": {"cluster": "cluster", "user": ACCOUNT}}],
                "current-context": ACCOUNT,
            }
        )
    )
    path.chmod(0o600)


def corefile(ip: str, kubeconfig: Path, ready_port: int) -> str:
    """One server block on ``ip``:53: the cluster's names (and its reverse zones) from the API
    server, everything else forwarded to the machine's resolver."""
    return f"""\
.:53 {{
    bind {ip}
    errors
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
}}
"""


def start_coredns(cluster: ControlPlane, bin_dir: Path, ip: str, work_dir: Path, logs: Path, timeout_s: float) -> ChildProcess:
    """Start CoreDNS on ``ip``:53 with its own credentials and files under ``work_dir``; returns
    once its ``ready`` endpoint answers (the kubernetes plugin has synced Services and
    EndpointSlices). A CoreDNS that does not get ready is stopped before the error is raised."""
    work_dir.mkdir()
    kubeconfig = work_dir / "kubeconfig"
    write_reader_kubeconfig(cluster, kubeconfig)
    ready_port = free_port()
    config = work_dir / "Corefile"
    config.write_text(corefile(ip, kubeconfig, ready_port))
    process = ChildProcess.spawn("coredns", [str(bin_dir / "coredns"), "-conf", str(config)], logs)

    def ready() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{ready_port}/ready", timeout=2) as reply:
            return int(reply.status) == 200

    try:
        process.wait_until("CoreDNS ready", ready, timeout_s)
    except BaseException:
        process.stop()
        raise
    return process
