"""A real Kubernetes node for tests: containerd + runc + CNI bridge, kubelet, kube-scheduler,
kube-proxy and the cluster's DNS (CoreDNS, :mod:`lorafleet_dev.dns`), joined to a
:class:`~lorafleet_dev.controlplane.ControlPlane` started with ``node_ip`` (its API server then
listens on the machine's own address, which pods can reach).

The binaries come from ``scripts/build-node.sh`` (:func:`find_node_bin_dir`,
:func:`~lorafleet_dev.dns.find_coredns_bin_dir`); runc and the CNI plugins are Debian's.
Everything the node writes lives under one work dir (containerd's state, the kubelet's root, pod
logs, CNI configuration and IP allocations, CoreDNS's files), except containerd's root, the
image store (:func:`store_dir`: content, snapshots, metadata; kept between nodes so an image is
imported and unpacked once, its records of containers, sandboxes and leases removed at stop
and at start), and what the kernel keeps machine-wide: the bridge interface, network namespaces (mounted under containerd's
state dir), cgroups (under :data:`CGROUP_PARENT`), the kubelet's and kube-proxy's iptables
rules and a few kernel settings (docs/kube-test-harness.md, "A real node"). :meth:`RealNode.stop`
takes all of that down again and reports what it could not (:meth:`RealNode.leftovers`). Since
those names are machine-wide, one node runs per machine at a time (:data:`MACHINE_LOCK`). It
needs root, overlayfs, runc, the CNI plugins, iptables and a memory cgroup
(:func:`check_machine`).

Typical use (``tests/kube/test_real_node.py``)::

    with ControlPlane.start(kube_bin, node_ip=machine_ip()) as cluster, \\
            RealNode.start(cluster, find_node_bin_dir(checkout),
                           find_coredns_bin_dir(checkout)) as node:
        node.import_image(archive)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lorafleet_dev.checkout import Checkout
from lorafleet_dev.controlplane import ControlPlane
from lorafleet_dev.dns import CLUSTER_DOMAIN, start_coredns
from lorafleet_dev.images import cache_root
from lorafleet_dev.mounts import mounts_under, unmount_all
from lorafleet_dev.oci import ArchiveImage, read_archive_image, write_image_archive
from lorafleet_dev.processes import ChildProcess, HarnessError, built_bin_dir, free_port

log = logging.getLogger(__name__)

NODE_BINARIES = ("kubelet", "kube-scheduler", "kube-proxy", "containerd", "ctr", "containerd-shim-runc-v2", "pause")
#: Debian's runc and CNI plugins (packages runc, containernetworking-plugins).
RUNC = Path("/usr/sbin/runc")
CNI_BIN_DIR = Path("/usr/lib/cni")
#: The pods' network: one Linux bridge, host-local addresses, the host is the gateway.
BRIDGE = "lorafleet0"
POD_SUBNET = "10.89.0.0/24"
#: The kubelet's cgroup root (in every cgroup hierarchy); removed by :meth:`RealNode.stop`.
CGROUP_PARENT = "lorafleet-node"
#: The sandbox image, imported from the pause binary build-node.sh compiles.
PAUSE_IMAGE = "localhost/lorafleet-pause:1"
CTR_NAMESPACE = "k8s.io"
#: Kernel settings the node changes machine-wide (the kubelet the first three, since
#: protectKernelDefaults is off; the CNI bridge plugin ip_forward): recorded at start, put back
#: by stop (docs/kube-test-harness.md, "What it changes on the machine").
#: One real node per machine at a time: the bridge, the pod subnet, the cgroup parent, the
#: iptables chains and the kernel settings are machine-wide. A second node (another test session
#: on a shared machine) waits for this lock.
MACHINE_LOCK = Path("/run/lock/lorafleet-node.lock")
KERNEL_SETTINGS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")


#: containerd's per-task and CRI per-container directories under its root: state of one run's
#: containers (all removed by then), never wanted by the next node.
_RUN_DIRS = ("io.containerd.runtime.v2.task", "io.containerd.grpc.v1.cri")


def store_dir() -> Path:
    """The node's image store, containerd's root, kept between nodes (one node at a time uses
    it: :data:`MACHINE_LOCK`): the imported images and their unpacked snapshots."""
    return cache_root() / "node-containerd"


def find_node_bin_dir(checkout: Checkout) -> Path:
    """The cached bin dir of scripts/build-node.sh (``LORAFLEET_NODE_BIN_DIR`` overrides it);
    nothing is built here: a missing build is an error naming the script."""
    return built_bin_dir(
        checkout.build_node_script, "LORAFLEET_NODE_BIN_DIR", NODE_BINARIES, "node binaries (kubelet, containerd, ...)", "minutes"
    )


def check_machine() -> None:
    """Refuse, naming the reason, a machine where a real node cannot start."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root (containerd, runc and the kubelet need root)")
    if "overlay" not in Path("/proc/filesystems").read_text():
        problems.append("no overlayfs in /proc/filesystems (containerd's snapshotter)")
    for tool in (RUNC, CNI_BIN_DIR / "bridge", CNI_BIN_DIR / "host-local", CNI_BIN_DIR / "loopback"):
        if not os.access(tool, os.X_OK):
            problems.append(f"{tool} missing (scripts/build-node.sh installs runc and containernetworking-plugins)")
    if shutil.which("iptables") is None:
        problems.append("no iptables (kube-proxy)")
    if not _cgroup_dirs("memory"):
        problems.append("no memory cgroup controller")
    if problems:
        raise HarnessError("a real node cannot start on this machine: " + "; ".join(problems))


def machine_ip() -> str:
    """The machine's own IPv4 address (the source address of its default route): what the API
    server advertises and the node registers, reachable from pods through the bridge gateway."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            # UDP connect sends nothing; it only picks the route (an off-link documentation
            # address: the default route) and its source address.
            sock.connect(("203.0.113.1", 9))
        except OSError as exc:
            raise HarnessError(f"no IPv4 route to find the machine's address: {exc}") from exc
        ip = str(sock.getsockname()[0])
    if ip.startswith("127."):
        raise HarnessError("the machine has only a loopback address; pods could not reach it")
    return ip


def _lock_machine(timeout_s: float) -> IO[str]:
    """Take :data:`MACHINE_LOCK` (waiting up to ``timeout_s`` for another node to stop); the
    lock is held while the returned file stays open."""
    lock = MACHINE_LOCK.open("a+")
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as busy:
            if time.monotonic() > deadline:
                lock.close()
                raise HarnessError(
                    f"another real node held {MACHINE_LOCK} for {timeout_s:.0f}s (one node per machine: the bridge and cgroups are shared)"
                ) from busy
            if not logged:
                log.info("waiting for another real node to stop (%s)", MACHINE_LOCK)
                logged = True
            time.sleep(1.0)
        else:
            return lock


def _cgroup_dirs(controller: str | None = None) -> list[Path]:
    """Mount points of the cgroup hierarchies (v1 controllers and the v2 unified one)."""
    dirs = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount_point, fstype, options, *_ = line.split()
        if fstype == "cgroup2" or (fstype == "cgroup" and (controller is None or controller in options.split(","))):
            dirs.append(Path(mount_point))
    return dirs


#: Chains the kubelet creates (per table) and the built-in chains that jump to them.
_KUBELET_CHAINS = {
    "filter": ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY"),
    "nat": ("KUBE-KUBELET-CANARY",),
    "mangle": ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"),
}
_KUBELET_JUMPS = (("filter", "INPUT", "KUBE-FIREWALL"), ("filter", "OUTPUT", "KUBE-FIREWALL"))


def _remove_kubelet_iptables() -> None:
    """Remove the kubelet's own iptables chains (kube-proxy --cleanup removes kube-proxy's);
    a chain that is not there is no error."""
    for tool in ("iptables", "ip6tables"):
        for table, chain, target in _KUBELET_JUMPS:
            subprocess.run([tool, "-t", table, "-D", chain, "-j", target], capture_output=True, check=False)
        for table, chains in _KUBELET_CHAINS.items():
            for name in chains:
                subprocess.run([tool, "-t", table, "-F", name], capture_output=True, check=False)
                subprocess.run([tool, "-t", table, "-X", name], capture_output=True, check=False)


@dataclass
class RealNode:
    """A running containerd + kubelet + kube-scheduler + kube-proxy registered as ``name``."""

    cluster: ControlPlane
    bin_dir: Path
    #: Where build-node.sh put CoreDNS (a cache of its own, keyed by CoreDNS's version).
    dns_bin_dir: Path
    work_dir: Path
    name: str
    ip: str
    #: containerd's root (:func:`store_dir`), kept after :meth:`stop`.
    store: Path
    #: The kubelet's HTTPS port on ``ip`` (its API: logs, exec, metrics).
    kubelet_port: int = field(default_factory=free_port)
    _procs: list[ChildProcess] = field(default_factory=list, repr=False)
    _kernel_settings: dict[str, str] = field(default_factory=dict, repr=False)
    _lock: IO[str] | None = field(default=None, repr=False)
    #: containerd's records of this run found at :meth:`stop` after removing them (none).
    _store_left: list[str] = field(default_factory=list, repr=False)

    @property
    def containerd_socket(self) -> Path:
        """containerd's gRPC socket (the CRI endpoint)."""
        return self.work_dir / "containerd" / "containerd.sock"

    # ---- lifecycle --------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        cluster: ControlPlane,
        bin_dir: Path,
        dns_bin_dir: Path,
        *,
        name: str = "lorafleet-node",
        ready_timeout_s: float = 120.0,
        lock_timeout_s: float = 480.0,
        store: Path | None = None,
    ) -> RealNode:
        """Start the node's processes and wait until its Node is Ready and untainted. The
        cluster's DNS (CoreDNS from ``dns_bin_dir``) serves on the node's address, port 53, and
        the kubelet gives pods that address as their nameserver.

        ``cluster`` must have been started with ``node_ip`` (pods reach its API server there).
        A failed start stops whatever did start and raises with the failing log's tail. Only
        one node runs on a machine at a time; a second waits up to ``lock_timeout_s``.
        ``store`` is containerd's root (default :func:`store_dir`), whose images stay.
        """
        check_machine()
        if cluster.advertise_ip == "127.0.0.1":
            raise HarnessError("RealNode needs ControlPlane.start(..., node_ip=machine_ip()): pods cannot reach an API server on loopback")
        lock = _lock_machine(lock_timeout_s)
        # On disk, not /dev/shm: image layers are hundreds of MB.
        work_dir = Path(tempfile.mkdtemp(prefix="lorafleet-node-", dir="/var/tmp"))
        node = cls(cluster, bin_dir, dns_bin_dir, work_dir, name, cluster.advertise_ip, store or store_dir(), _lock=lock)
        try:
            node._boot(ready_timeout_s)
        except BaseException:
            node.stop()
            raise
        return node

    def _boot(self, timeout_s: float) -> None:
        logs = self.work_dir / "logs"
        logs.mkdir()
        started = time.monotonic()
        self._kernel_settings = {k: (Path("/proc/sys") / k).read_text().strip() for k in KERNEL_SETTINGS}
        self._start_containerd(logs, timeout_s)
        self.import_image(self._pause_archive())
        self._start_kube_proxy(logs)
        self._start_scheduler(logs)
        self._procs.append(start_coredns(self.cluster, self.dns_bin_dir, self.ip, self.work_dir / "coredns", logs, timeout_s))
        self._start_kubelet(logs, timeout_s)
        log.info("node %s ready in %.1fs (work dir %s)", self.name, time.monotonic() - started, self.work_dir)

    def _start_containerd(self, logs: Path, timeout_s: float) -> None:
        """Start containerd on the kept store, with no record of an earlier node's containers:
        a run that could not stop cleanly (killed) left some, which are removed and containerd
        started again, so that its CRI plugin does not recover them."""
        for name in _RUN_DIRS:
            shutil.rmtree(self.store / name, ignore_errors=True)
        config = self._write_containerd_config()
        self._spawn_containerd(config, logs, timeout_s)
        if stale := self._store_records():
            log.warning("removing %d records an earlier node left in %s: %s", len(stale), self.store, stale[:5])
            self._forget_containers()
            containerd = self._procs.pop()
            containerd.stop()
            self._spawn_containerd(config, logs, timeout_s)
            if stale := self._store_records():
                raise HarnessError(f"containerd's store {self.store} keeps records: {stale}")

    def _spawn_containerd(self, config: Path, logs: Path, timeout_s: float) -> None:
        proc = self._spawn("containerd", [str(self.bin_dir / "containerd"), "--config", str(config)], logs)
        proc.wait_until("containerd's socket", lambda: self._ctr("version").returncode == 0, timeout_s, 0.2)

    def _write_containerd_config(self) -> Path:
        state = self.work_dir / "containerd"
        cni_conf = self.work_dir / "cni" / "net.d"
        cni_conf.mkdir(parents=True)
        self._write_cni_config(cni_conf)
        state.mkdir(exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        config = state / "config.toml"
        config.write_text(f"""\
version = 3
root = '{self.store}'
state = '{state}/state'

[grpc]
  address = '{self.containerd_socket}'

[plugins.'io.containerd.internal.v1.opt']
  # Otherwise containerd creates /opt/containerd.
  path = '{state}/opt'

[plugins.'io.containerd.gc.v1.scheduler']
  # Collect at once after a deletion (a replaced image's snapshots, the records stop removes).
  deletion_threshold = 1

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{PAUSE_IMAGE}'

[plugins.'io.containerd.cri.v1.runtime']
  # Required here: root lacks CAP_SYS_RESOURCE, so the sandbox's oom_score_adj of -998 would be
  # refused and every pod fail ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  # Network namespaces under our state dir, not /var/run/netns.
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    # Our shim build, not one looked up on PATH.
    runtime_path = '{self.bin_dir / "containerd-shim-runc-v2"}'
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
    BinaryName = '{RUNC}'
    # runc's state under ours, not /run/containerd/runc.
    Root = '{state}/state/runc'
    SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{CNI_BIN_DIR}']
    conf_dir = '{cni_conf}'

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'

[plugins.'io.containerd.nri.v1.nri']
  disable = true
""")
        return config

    def _write_cni_config(self, conf_dir: Path) -> None:
        conflist = {
            "cniVersion": "1.0.0",
            "name": "lorafleet",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    # The host is the pods' gateway; no masquerading: pods talk to this machine only.
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.work_dir / "cni" / "ipam"),
                    },
                }
            ],
        }
        (conf_dir / "10-lorafleet.conflist").write_text(json.dumps(conflist, indent=2))

    def _pause_archive(self) -> Path:
        """A one-file OCI image archive around the pause binary (written by Python, no builder)."""
        archive = self.work_dir / "pause.tar"
        write_image_archive(archive, PAUSE_IMAGE, {"pause": self.bin_dir / "pause"}, entrypoint=["/pause"])
        return archive

    def _start_kube_proxy(self, logs: Path) -> None:
        config = self.work_dir / "kube-proxy.yaml"
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {"kubeconfig": str(self.cluster.kubeconfig)},
                    "mode": "iptables",
                    "hostnameOverride": self.name,
                    "clusterCIDR": POD_SUBNET,
                    "bindAddress": self.ip,
                    "healthzBindAddress": f"127.0.0.1:{free_port()}",
                    "metricsBindAddress": f"127.0.0.1:{free_port()}",
                    # Leave the machine's conntrack sysctls alone (0 means "do not set").
                    "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
                    # No route_localnet sysctl: nothing uses NodePorts on 127.0.0.1.
                    "iptables": {"localhostNodePorts": False},
                }
            )
        )
        self._spawn("kube-proxy", [str(self.bin_dir / "kube-proxy"), f"--config={config}", "--v=1"], logs)

    def _start_scheduler(self, logs: Path) -> None:
        self._spawn(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--authentication-kubeconfig={self.cluster.kubeconfig}",
                f"--authorization-kubeconfig={self.cluster.kubeconfig}",
                "--leader-elect=false",
                f"--secure-port={free_port()}",
                "--bind-address=127.0.0.1",
                "--v=1",
            ],
            logs,
        )

    def _start_kubelet(self, logs: Path, timeout_s: float) -> None:
        root = self.work_dir / "kubelet"
        root.mkdir()
        for hierarchy in _cgroup_dirs():
            (hierarchy / CGROUP_PARENT).mkdir(exist_ok=True)
        config = self.work_dir / "kubelet.yaml"
        config.write_text(json.dumps(self._kubelet_config(), indent=2))
        proc = self._spawn(
            "kubelet",
            [
                str(self.bin_dir / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--root-dir={root}",
                f"--cert-dir={root / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.ip}",
                "--v=1",
            ],
            logs,
        )
        proc.wait_until(f"Node {self.name} Ready and untainted", self._node_ready, timeout_s, 0.5)

    def _kubelet_config(self) -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{CGROUP_PARENT}",
            # Kubernetes 1.35 refuses cgroup v1 unless told otherwise; this machine is v1 hybrid.
            "failCgroupV1": False,
            # The kubelet sets vm.overcommit_memory=1, kernel.panic=10, kernel.panic_on_oops=1
            # instead of refusing to start (acceptable on a test VM; the harness doc says so).
            "protectKernelDefaults": False,
            "failSwapOn": False,
            "address": self.ip,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            # The API server calls the kubelet (logs, exec) without a client certificate.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "podLogsDir": str(self.work_dir / "pod-logs"),
            "registerNode": True,
            # A busy shared disk must not evict test pods nor garbage-collect imported images
            # (they cannot be pulled again: there is no registry).
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "maxPods": 50,
            "staticPodPath": "",
            # ClusterFirst pods get CoreDNS (on this machine's address) as their nameserver and
            # the cluster's search domains; the machine's own resolv.conf gives the rest.
            "clusterDNS": [self.ip],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": "/etc/resolv.conf",
        }

    def _node_ready(self) -> bool:
        status, node = self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
        if status != 200 or not isinstance(node, dict):
            return False
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", []))
        # A taint (not-ready, set from the conditions by the node-lifecycle controller) would
        # keep the scheduler from placing pods here yet.
        return ready and not node.get("spec", {}).get("taints")

    def _spawn(self, name: str, argv: list[str], logs: Path) -> ChildProcess:
        proc = ChildProcess.spawn(name, argv, logs)
        self._procs.append(proc)
        return proc

    # ---- images -----------------------------------------------------------------------------

    def _ctr(self, *args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "ctr"), f"--address={self.containerd_socket}", f"--namespace={CTR_NAMESPACE}", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def import_image(self, archive: Path) -> bool:
        """Make the image of an archive (OCI or docker-archive) the kubelet's: ``ctr images
        import`` unless the store already holds that name with the archive's config digest,
        unpacked. The layers' blobs are dropped once unpacked (the agent image's are gigabytes;
        the snapshots are what containers run from), so the image is held once, not twice.
        Other tags of the same repository are removed then (the image replaced them; their
        snapshots go unless the new image shares them). Returns whether it imported."""
        image = read_archive_image(archive)
        if self._holds(image):
            log.info("%s already in the node's store", image.name)
            return False
        started = time.monotonic()
        proc = self._ctr("images", "import", "--local", "--all-platforms", "--discard-unpacked-layers", str(archive), timeout_s=900.0)
        if proc.returncode != 0:
            raise HarnessError(f"ctr images import {archive} failed:\n{proc.stderr}")
        log.info("imported %s in %.1fs", archive.name, time.monotonic() - started)
        repository = image.name.rsplit(":", 1)[0]
        for name in self.images():
            if name != image.name and name.rsplit(":", 1)[0] == repository:
                self._ctr("images", "rm", "--sync", name)
                log.info("removed %s from the node's store (replaced by %s)", name, image.name)
        return True

    def _holds(self, image: ArchiveImage) -> bool:
        """Whether ``image.name`` is in the store with the same config and its top snapshot."""
        listed = self._ctr("images", "list", f"name=={image.name}").stdout.splitlines()[1:]
        if not listed:
            return False
        target = json.loads(self._ctr("content", "get", listed[0].split()[2]).stdout or "{}")
        if "manifests" in target:  # an index: the image's one manifest
            (only,) = target["manifests"]
            target = json.loads(self._ctr("content", "get", only["digest"]).stdout or "{}")
        return bool(
            target.get("config", {}).get("digest") == image.config_digest and self._ctr("snapshots", "info", image.chain_id).returncode == 0
        )

    def _listed(self, *args: str) -> list[str]:
        """The first column of a ``ctr ... list`` table, its header left out."""
        return [line.split()[0] for line in self._ctr(*args).stdout.splitlines()[1:] if line.strip()]

    def _store_records(self) -> list[str]:
        """containerd's records of containers: tasks, containers, pod sandboxes, leases and
        active (writable) snapshots. Between nodes there are none; the images' committed
        snapshots are what the store keeps."""
        found = [f"task {t}" for t in self.running_containers()]
        found += [f"container {c}" for c in self._ctr("containers", "list", "--quiet").stdout.split()]
        found += [f"sandbox {s}" for s in self._listed("sandboxes", "list")]
        found += [f"lease {lease}" for lease in self._ctr("leases", "list", "--quiet").stdout.split()]
        found += [
            f"active snapshot {line.split()[0]}"
            for line in self._ctr("snapshots", "list").stdout.splitlines()[1:]
            if line.split()[-1:] == ["Active"]
        ]
        return found

    def _forget_containers(self, timeout_s: float = 30.0) -> None:
        """Remove every task (killed), container (its snapshot with it), sandbox and lease
        from the store, and wait until the collector has removed the snapshots they held."""
        for task in self.running_containers():
            self._ctr("tasks", "delete", "--force", task)
        for container in self._ctr("containers", "list", "--quiet").stdout.split():
            self._ctr("containers", "delete", container)
        for sandbox in self._listed("sandboxes", "list"):
            self._ctr("sandboxes", "remove", "--force", sandbox)
        for lease in self._ctr("leases", "list", "--quiet").stdout.split():
            self._ctr("leases", "delete", lease)
        deadline = time.monotonic() + timeout_s
        while self._store_records() and time.monotonic() < deadline:
            time.sleep(0.2)

    def images(self) -> list[str]:
        """Names of the images containerd holds for the kubelet."""
        proc = self._ctr("images", "list", "--quiet")
        return proc.stdout.split()

    def running_containers(self) -> list[str]:
        """IDs of the containers (pod sandboxes included) running for the kubelet: containerd's
        tasks. Exited containers stay listed by ``ctr containers`` until the kubelet's garbage
        collection, every minute; their tasks are gone at once."""
        return self._ctr("tasks", "list", "--quiet").stdout.split()

    def kubelet_metrics(self, path: str = "/metrics/probes") -> str:
        """A Prometheus text page of the kubelet's own API (``/metrics/probes``: every liveness,
        readiness and start-up probe it ran, by pod, container and result). Its certificate is
        self-signed, so it is not verified: this is the node we started."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(f"https://{self.ip}:{self.kubelet_port}{path}", timeout=10, context=context) as reply:
            return str(reply.read().decode())

    def logs(self, name: str, lines: int = 60) -> str:
        """The tail of one component's log (containerd, kubelet, kube-scheduler, kube-proxy,
        coredns)."""
        for proc in self._procs:
            if proc.name == name:
                return proc.log_tail(lines)
        return ""

    # ---- shutdown ---------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Delete the node's pods, stop every process, and remove what they left on the machine:
        containerd's records of them (the store keeps only images), mounts, network namespaces,
        the bridge, cgroups, iptables rules, the work dir; and put back the kernel settings it
        changed. Returns :meth:`leftovers` as found before the machine lock is released (after
        that, the next node's things would be counted)."""
        self._drain()
        containerd = [p for p in self._procs if p.name == "containerd"]
        for proc in reversed(self._procs):
            if proc.name != "containerd":
                proc.stop()
        if any(p.popen.poll() is None for p in containerd):
            # With the kubelet gone nothing makes new ones; what containerd still records of
            # this run must not reach the next node.
            self._forget_containers()
            self._store_left = self._store_records()
        for proc in containerd:
            proc.stop()
        self._procs.clear()
        self._kill_leftover_shims()
        unmount_all(self.work_dir)
        unmount_all(self.store)
        subprocess.run(["ip", "link", "delete", BRIDGE], check=False, capture_output=True)
        subprocess.run([str(self.bin_dir / "kube-proxy"), "--cleanup"], check=False, capture_output=True)
        _remove_kubelet_iptables()
        self._remove_cgroups()
        for key, value in self._kernel_settings.items():
            (Path("/proc/sys") / key).write_text(value)
        if os.environ.get("LORAFLEET_KEEP_KUBE_DIR"):
            log.warning("kept node work dir %s", self.work_dir)
        else:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        left = self.leftovers()
        if self._lock is not None:
            self._lock.close()  # releases the machine lock for the next node
            self._lock = None
        return left

    def leftovers(self) -> list[str]:
        """What of this node is still on the machine (after :meth:`stop`: nothing), described:
        processes of its binaries or naming its work dir, mounts under it or the store
        (overlay snapshots, network namespaces, volumes), containerd's records of its
        containers (tasks, containers, sandboxes, leases, writable snapshots, as :meth:`stop`
        found them before stopping containerd), the bridge, cgroups, kube-* iptables chains,
        changed kernel settings, the work dir."""
        found = [f"process {pid}: {cmd}" for pid, cmd in self._own_processes()]
        found += [f"mount {point}" for point in mounts_under(self.work_dir) + mounts_under(self.store)]
        found += [f"containerd record: {record}" for record in self._store_left]
        if Path("/sys/class/net", BRIDGE).exists():
            found.append(f"network interface {BRIDGE}")
        found += [f"cgroup {h / CGROUP_PARENT}" for h in _cgroup_dirs() if (h / CGROUP_PARENT).exists()]
        for tool in ("iptables-save", "ip6tables-save"):
            rules = subprocess.run([tool], capture_output=True, text=True, check=False).stdout
            found += [f"{tool}: {line}" for line in rules.splitlines() if "KUBE-" in line]
        for key, value in self._kernel_settings.items():
            now = (Path("/proc/sys") / key).read_text().strip()
            if now != value:
                found.append(f"kernel setting {key} = {now} (was {value})")
        if self.work_dir.exists():
            found.append(f"work dir {self.work_dir}")
        return found

    def _own_processes(self) -> list[tuple[int, str]]:
        """Running programs of our bin dirs whose arguments name our work dir: this node's
        containerd, kubelet, kube-proxy, CoreDNS and shims (kube-scheduler names only the
        cluster's kubeconfig; it is a ChildProcess, stopped and reaped). Pods' processes are in
        the cgroups (see :meth:`leftovers`). Nobody else's process matches, however it is named."""
        programs = tuple(str(d).encode() + b"/" for d in (self.bin_dir, self.dns_bin_dir))
        work_dir = str(self.work_dir).encode()
        found = []
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
                if argv[0].startswith(programs) and any(work_dir in a for a in argv[1:]):
                    command = b" ".join(argv).decode(errors="replace")
                    found.append((int(pid_dir.name), command[:120]))
        return found

    def _drain(self, timeout_s: float = 60.0) -> None:
        """Delete every pod bound to this node and wait until containerd runs no container, so
        the kubelet itself tears down sandboxes (CNI teardown, netns, volume mounts)."""
        if not any(p.name == "kubelet" and p.popen.poll() is None for p in self._procs):
            return
        with contextlib.suppress(HarnessError, subprocess.TimeoutExpired):
            self.cluster.kubectl(
                "delete",
                "pods",
                "--all-namespaces",
                "--force",
                "--grace-period=0",
                f"--field-selector=spec.nodeName={self.name}",
                "--wait=false",
                timeout_s=30,
            )
        deadline = time.monotonic() + timeout_s
        while self.running_containers() and time.monotonic() < deadline:
            time.sleep(0.5)
        if left := self.running_containers():
            log.warning("containers still running after draining node %s: %s", self.name, left)

    def _kill_leftover_shims(self) -> None:
        """containerd-shim-runc-v2 processes outlive containerd by design (ours name our
        socket); a drain that timed out leaves them, with their containers. Everything else of
        ours is stopped by then, so what :meth:`_own_processes` still finds is shims."""
        for pid, _ in self._own_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _remove_cgroups(self) -> None:
        """Kill what still runs in the kubelet's cgroups (containers of a drain that timed out)
        and rmdir the trees, deepest first (a cgroup dir holds only pseudo-files)."""
        for hierarchy in _cgroup_dirs():
            top = hierarchy / CGROUP_PARENT
            if not top.is_dir():
                continue
            walk = sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True)
            for dirpath, _, _ in walk:
                with contextlib.suppress(OSError, ValueError):
                    for pid in (Path(dirpath) / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
            for dirpath, _, _ in walk:
                for _ in range(20):  # killed processes leave their cgroup a moment later
                    try:
                        os.rmdir(dirpath)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.05)

    def __enter__(self) -> RealNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
