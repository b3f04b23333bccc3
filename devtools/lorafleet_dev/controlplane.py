"""A real Kubernetes control plane (etcd + kube-apiserver + kube-controller-manager) on loopback.

Used by the demo (``python -m lorafleet_dev.demo``), the tests (through ``tests/kube/harness.py``)
and the operator benchmark. The binaries come from ``scripts/build-kube.sh`` (built from Go
modules, cached by version; :func:`find_bin_dir`). :class:`ControlPlane` starts them as child
processes with their own CA, serving certificate, service-account keys and an admin identity
(:mod:`lorafleet_dev.pki`), and offers the real ``kubectl``/``helm`` binaries against the
cluster, namespaces, and agent Pods (:mod:`lorafleet_dev.kubelet`: there is no kubelet and no
scheduler; node agents run as local processes on 127.0.0.1 and their Pod objects only describe
them).

Typical use (``tests/conftest.py`` wraps it in a session fixture)::

    with ControlPlane.start(find_bin_dir(Checkout.at(repo))) as cluster:
        cluster.kubectl("get", "namespaces")
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet_dev.checkout import Checkout
from lorafleet_dev.kubelet import StandInKubelet
from lorafleet_dev.pki import ControlPlanePki, make_control_plane_pki
from lorafleet_dev.processes import ChildProcess, HarnessError, built_bin_dir, free_port

log = logging.getLogger(__name__)

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm")
ADMIN_USER = "lorafleet-admin"
#: The first address of --service-cluster-ip-range: the ``kubernetes`` Service's ClusterIP.
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"

#: Controllers that make sense without kubelets. In particular no node-lifecycle (it would mark
#: hand-written Ready pods NotReady) and no podgc (it would delete pods bound to a node that has
#: no Node object).
BASE_CONTROLLERS = (
    "namespace-controller",
    "garbage-collector-controller",
    "serviceaccount-controller",
    "clusterrole-aggregation-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
)
#: Added when a real node joins (:mod:`lorafleet_dev.node`): workloads become pods, Jobs (Helm
#: hooks) run, node-lifecycle keeps the Node's not-ready/unreachable taints in step with its
#: Ready condition, and claims bind to statically provisioned volumes (the binder; the two
#: protection controllers release the finalizers the API server puts on claims and volumes, or
#: a namespace holding a claim would never finish deleting). Still no podgc: stand-in pods
#: bound to a node without a Node object may coexist with real ones.
NODE_CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "job-controller",
    "disruption-controller",
    "endpointslice-controller",
    "node-lifecycle-controller",
    "persistentvolume-binder-controller",
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
)


class KubectlError(HarnessError):
    """kubectl exited non-zero; carries its output so a failing test shows the server's words."""

    def __init__(self, args: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.args_run = list(args)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"kubectl {' '.join(args)} exited {returncode}:\n{stderr or stdout}")


def find_bin_dir(checkout: Checkout) -> Path:
    """Return the cached bin dir with all control-plane binaries, without building anything.

    ``LORAFLEET_KUBE_BIN_DIR`` overrides the location; otherwise the checkout's
    ``scripts/build-kube.sh`` (which alone knows the versions, hence the cache path) names it. Building takes 10-20 minutes cold, far
    longer than a test should wait, so a missing build is an error telling what to run.
    """
    return built_bin_dir(
        checkout.build_kube_script, "LORAFLEET_KUBE_BIN_DIR", BINARIES, "Kubernetes control-plane binaries", "10-20 minutes"
    )


@dataclass
class ControlPlane(StandInKubelet):
    """A running etcd + kube-apiserver (+ kube-controller-manager) and helpers to use them."""

    bin_dir: Path
    work_dir: Path
    server: str
    token: str
    ca_file: Path
    kubeconfig: Path
    with_controller_manager: bool
    #: The address kube-apiserver listens on and advertises: 127.0.0.1, or the machine's own
    #: address when pods of a real node must reach it (``start(node_ip=...)``).
    advertise_ip: str = "127.0.0.1"
    #: GOGC of etcd and kube-apiserver (None: Go's default, 100). A benchmark that shares a
    #: small machine's cores with them may trade their memory for CPU (``start(go_gc=...)``).
    go_gc: int | None = None
    _procs: list[ChildProcess] = field(default_factory=list, repr=False)
    _keep_work_dir: bool = field(default=False, repr=False)

    # ---- lifecycle --------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        bin_dir: Path,
        *,
        with_controller_manager: bool = True,
        ready_timeout_s: float = 180.0,
        attempts: int = 3,
        node_ip: str | None = None,
        go_gc: int | None = None,
    ) -> ControlPlane:
        """Start a fresh cluster on free loopback ports; retries when a port was taken meanwhile.

        With ``with_controller_manager`` the namespace, garbage-collector and service-account
        controllers run (namespace deletion, ownerReference GC and "default" ServiceAccounts);
        without it the ServiceAccount admission plugin is disabled instead. ``node_ip`` (the
        machine's own address, for a real node: :mod:`lorafleet_dev.node`) makes the API server
        listen and advertise there, with that address in its certificate, the ``kubernetes``
        Endpoints maintained, and the workload controllers running too. ``go_gc`` sets GOGC
        for etcd and kube-apiserver (see :attr:`go_gc`).
        """
        last: HarnessError | None = None
        for attempt in range(1, attempts + 1):
            shm = Path("/dev/shm")
            work_dir = Path(tempfile.mkdtemp(prefix="lorafleet-kube-", dir=shm if shm.is_dir() else None))
            cluster = cls._new(bin_dir, work_dir, with_controller_manager)
            if node_ip:
                cluster.advertise_ip = node_ip
            cluster.go_gc = go_gc
            try:
                cluster._boot(ready_timeout_s)
                return cluster
            except HarnessError as exc:
                last = exc
                already_in_use = "address already in use" in str(exc)
                # Keep the logs of a real failure for diagnosis; a port race is just retried.
                cluster._keep_work_dir = not already_in_use
                cluster.stop()
                if not already_in_use:
                    raise
                log.warning("port taken during start-up (attempt %d); retrying", attempt)
        assert last is not None
        raise last

    @classmethod
    def _new(cls, bin_dir: Path, work_dir: Path, with_controller_manager: bool) -> ControlPlane:
        token = secrets.token_urlsafe(32)
        return cls(
            bin_dir=bin_dir,
            work_dir=work_dir,
            server="",
            token=token,
            ca_file=work_dir / "pki" / "ca.crt",
            kubeconfig=work_dir / "kubeconfig",
            with_controller_manager=with_controller_manager,
        )

    def _boot(self, ready_timeout_s: float) -> None:
        # In-cluster clients dial the advertised address or the kubernetes Service's ClusterIP.
        extra_ips = () if self.advertise_ip == "127.0.0.1" else (self.advertise_ip, KUBERNETES_SERVICE_IP)
        pki = make_control_plane_pki(self.work_dir / "pki", extra_ips=extra_ips)
        logs = self.work_dir / "logs"
        logs.mkdir()
        etcd_url = self._start_etcd(ready_timeout_s, logs)
        self._start_apiserver(pki, etcd_url, ready_timeout_s, logs)
        if self.with_controller_manager:
            self._start_controller_manager(pki, ready_timeout_s, logs)
        log.info("control plane ready at %s (work dir %s)", self.server, self.work_dir)

    def _start_etcd(self, timeout_s: float, logs: Path) -> str:
        client = f"http://127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        proc = ChildProcess.spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=lorafleet",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=lorafleet={peer}",
                "--initial-cluster-state=new",
                # Test data is disposable: skip fsync, it is the slowest part of etcd on a busy disk.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            logs,
            self._go_env(),
        )
        self._procs.append(proc)

        def healthy() -> bool:
            with urllib.request.urlopen(f"{client}/health", timeout=2) as resp:
                return bool(json.load(resp).get("health") == "true")

        proc.wait_until("etcd /health", healthy, timeout_s)
        return client

    def _start_apiserver(self, pki: ControlPlanePki, etcd_url: str, timeout_s: float, logs: Path) -> None:
        port = free_port()
        self.server = f"https://{self.advertise_ip}:{port}"
        loopback = self.advertise_ip == "127.0.0.1"
        tokens = self.work_dir / "tokens.csv"
        tokens.write_text(f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        tokens.chmod(0o600)
        argv = [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={self.advertise_ip}",
            f"--secure-port={port}",
            f"--advertise-address={self.advertise_ip}",
            # The "kubernetes" Endpoints object refuses loopback addresses; nothing needs it
            # then. With a real node's pods it points them at the API server.
            f"--endpoint-reconciler-type={'none' if loopback else 'lease'}",
            f"--cert-dir={self.work_dir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={tokens}",
            "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]
        if not loopback:
            # The node's name resolves nowhere; `kubectl logs` reaches its kubelet by address.
            argv.append("--kubelet-preferred-address-types=InternalIP")
        if not self.with_controller_manager:
            # Pods would wait for a "default" ServiceAccount that only a controller creates.
            argv.append("--disable-admission-plugins=ServiceAccount")
        proc = ChildProcess.spawn("kube-apiserver", argv, logs, self._go_env())
        self._procs.append(proc)
        self._write_kubeconfig()
        proc.wait_until("kube-apiserver /readyz", self._apiserver_ready, timeout_s, 0.5)

    def _go_env(self) -> dict[str, str] | None:
        """The environment of etcd and kube-apiserver: ours, with :attr:`go_gc` if set."""
        return None if self.go_gc is None else {**os.environ, "GOGC": str(self.go_gc)}

    def _apiserver_ready(self) -> bool:
        status, _ = self.request("GET", "/readyz")
        return status == 200

    def _start_controller_manager(self, pki: ControlPlanePki, timeout_s: float, logs: Path) -> None:
        controllers: tuple[str, ...] = BASE_CONTROLLERS
        if self.advertise_ip != "127.0.0.1":
            controllers += NODE_CONTROLLERS
        kubeconfig = self.work_dir / "controller-manager.kubeconfig"
        self._write_kubeconfig_file(
            kubeconfig,
            "kube-controller-manager",
            {"client-certificate": str(pki.controller_manager_cert), "client-key": str(pki.controller_manager_key)},
        )
        proc = ChildProcess.spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                # No HTTPS endpoint of its own: nothing scrapes it, and it would need another port.
                "--secure-port=0",
                "--leader-elect=false",
                f"--controllers={','.join(controllers)}",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca_cert}",
                "--use-service-account-credentials=false",
                "--profiling=false",
                "--v=1",
            ],
            logs,
        )
        self._procs.append(proc)

        def default_sa_exists() -> bool:
            status, _ = self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
            return status == 200

        proc.wait_until("the controller manager to create ServiceAccount default/default", default_sa_exists, timeout_s, 0.5)

    def stop(self) -> None:
        """Stop every process (newest first) and remove the work dir unless kept for a failure."""
        for proc in reversed(self._procs):
            proc.stop()
        self._procs.clear()
        if self._keep_work_dir or os.environ.get("LORAFLEET_KEEP_KUBE_DIR"):
            log.warning("kept control-plane work dir %s", self.work_dir)
        else:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def restart_apiserver(self, downtime_s: float = 0.0, ready_timeout_s: float = 120.0) -> None:
        """Stop kube-apiserver, wait ``downtime_s``, start it again on the same port and wait
        for /readyz (a fault for operator tests: watches break, requests fail meanwhile).
        etcd keeps running, so every object survives."""
        index = next(i for i, p in enumerate(self._procs) if p.name == "kube-apiserver")
        old = self._procs[index]
        old.stop()
        time.sleep(downtime_s)
        new = ChildProcess.spawn(old.name, old.argv, old.log_path.parent, old.env)
        self._procs[index] = new
        new.wait_until("kube-apiserver /readyz after restart", self._apiserver_ready, ready_timeout_s, 0.5)

    def restart_etcd(self, downtime_s: float = 0.0, ready_timeout_s: float = 120.0) -> None:
        """Stop etcd, wait ``downtime_s``, start it again on the same ports and data dir, and
        wait until kube-apiserver is ready again (a fault for operator tests: the API server
        answers errors meanwhile, its watches restart). The data survives."""
        index = next(i for i, p in enumerate(self._procs) if p.name == "etcd")
        old = self._procs[index]
        old.stop()
        time.sleep(downtime_s)
        new = ChildProcess.spawn(old.name, old.argv, old.log_path.parent, old.env)
        self._procs[index] = new
        new.wait_until("kube-apiserver /readyz after the etcd restart", self._apiserver_ready, ready_timeout_s, 0.5)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        """PIDs of the running control-plane processes (tests check none outlive stop())."""
        return [p.popen.pid for p in self._procs if p.popen.poll() is None]

    def logs(self, name: str, lines: int = 60) -> str:
        """The tail of one component's log (etcd, kube-apiserver, kube-controller-manager)."""
        for proc in self._procs:
            if proc.name == name:
                return proc.log_tail(lines)
        return ""

    # ---- kubeconfig and raw requests --------------------------------------------------------

    def _write_kubeconfig(self) -> None:
        self._write_kubeconfig_file(self.kubeconfig, ADMIN_USER, {"token": self.token})

    def _write_kubeconfig_file(self, path: Path, user: str, credentials: dict[str, str]) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "lorafleet-test", "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": "lorafleet-test", "context": {"cluster": "lorafleet-test", "user": user}}],
            "current-context": "lorafleet-test",
        }
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML; no dependency needed
        path.chmod(0o600)

    def ssl_context(self) -> ssl.SSLContext:
        """An SSL context that trusts this cluster's CA (for raw HTTPS calls)."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(self, method: str, path: str, body: Any = None, timeout_s: float = 5.0) -> tuple[int, Any]:
        """One admin HTTPS request to the API server; returns (status, decoded JSON or text)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self.ssl_context()) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    # ---- real CLI tools ---------------------------------------------------------------------

    def tool_env(self) -> dict[str, str]:
        """Environment for kubectl/helm (and operator processes) pointed at this cluster only."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        # Keep helm's and kubectl's caches and config out of $HOME and per cluster.
        for var, sub in (("HELM_CACHE_HOME", "helm/cache"), ("HELM_CONFIG_HOME", "helm/config"), ("HELM_DATA_HOME", "helm/data")):
            env[var] = str(self.work_dir / sub)
        return env

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        as_user: str | None = None,
        as_groups: Sequence[str] = (),
        check: bool = True,
        timeout_s: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl as admin, or impersonating ``as_user`` (and ``as_groups``).

        Raises KubectlError (with stderr) on a non-zero exit unless ``check`` is False.
        """
        argv = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.work_dir / 'kubectl-cache'}"]
        if as_user:
            argv.append(f"--as={as_user}")
        argv += [f"--as-group={g}" for g in as_groups]
        argv += list(args)
        proc = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=self.tool_env(),
            check=False,
        )
        if check and proc.returncode != 0:
            raise KubectlError(args, proc.returncode, proc.stdout, proc.stderr)
        return proc

    def kubectl_json(self, *args: str, **kwargs: Any) -> Any:
        """kubectl with ``-o json``, decoded."""
        return json.loads(self.kubectl(*args, "-o", "json", **kwargs).stdout)

    def helm(self, *args: str, check: bool = True, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run the real helm binary against this cluster."""
        proc = subprocess.run(
            [str(self.bin_dir / "helm"), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=self.tool_env(),
            check=False,
        )
        if check and proc.returncode != 0:
            raise HarnessError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def apply(self, manifest: str, namespace: str | None = None, *extra: str) -> str:
        """``kubectl apply --validate=strict -f -`` of a YAML/JSON manifest; returns stdout."""
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", "--validate=strict", *ns, *extra, "-f", "-", input=manifest).stdout

    # ---- namespaces -------------------------------------------------------------------------

    def create_namespace(self, name: str | None = None, *, prefix: str = "t", wait_s: float = 60.0) -> str:
        """Create a namespace (random name unless given) and return its name.

        With the controller manager running this waits for its "default" ServiceAccount,
        because pod creation is refused until it exists.
        """
        name = name or f"{prefix}-{secrets.token_hex(4)}"
        self.kubectl("create", "namespace", name)
        if self.with_controller_manager:
            deadline = time.monotonic() + wait_s
            while True:
                status, _ = self.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
                if status == 200:
                    break
                if time.monotonic() > deadline:
                    raise HarnessError(f"ServiceAccount {name}/default never appeared")
                time.sleep(0.1)
        return name

    def delete_namespace(self, name: str, *, wait: bool = False) -> None:
        """Delete a namespace; the controller manager empties and removes it."""
        self.kubectl("delete", "namespace", name, "--ignore-not-found", f"--wait={'true' if wait else 'false'}")
