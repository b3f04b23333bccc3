"""Leader election on a real Lease: one leader at a time, takeover after expiry or release; a
leader whose reconcile loop fails releases the Lease and exits (the real operator, a real kopf
failure on the real API server)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lorafleet_operator.config import ADAPTERS, GROUP, VERSION, Settings
from lorafleet_operator.kube import make_api_client
from lorafleet_operator.leader import LeaderElector
from tests.kube.harness import ControlPlane
from tests.operator.agents import apply, fleet_manifest
from tests.operator.conftest import start_operator, wait_for


def elector(cluster: ControlPlane, namespace: str, identity: str) -> LeaderElector:
    settings = Settings(lease_name="lf-test", lease_namespace=namespace, identity=identity, lease_duration_s=2.0)
    return LeaderElector(make_api_client(str(cluster.kubeconfig)), settings)


def holder(cluster: ControlPlane, namespace: str) -> str:
    lease = cluster.kubectl_json("get", "lease", "lf-test", "-n", namespace)
    return str(lease["spec"].get("holderIdentity") or "")


def test_one_leader_then_takeover_after_expiry(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    a, b = elector(kube_cluster, kube_namespace, "a"), elector(kube_cluster, kube_namespace, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # a's lease is fresh
    assert a.try_acquire_or_renew()  # renewing works
    assert holder(kube_cluster, kube_namespace) == "a"
    # a stops renewing; b, observing no change for the lease duration, takes over.
    deadline = time.monotonic() + 30
    while not b.try_acquire_or_renew():
        assert time.monotonic() < deadline, "b never took over an expired lease"
        time.sleep(0.2)
    assert holder(kube_cluster, kube_namespace) == "b"
    lease = kube_cluster.kubectl_json("get", "lease", "lf-test", "-n", kube_namespace)
    assert lease["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()  # a now sees b's fresh lease


def test_release_hands_over_at_once(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    a, b = elector(kube_cluster, kube_namespace, "a"), elector(kube_cluster, kube_namespace, "b")
    assert a.try_acquire_or_renew()
    a.leading = True
    assert not b.try_acquire_or_renew()
    a.release()
    assert holder(kube_cluster, kube_namespace) == ""
    assert b.try_acquire_or_renew()  # no waiting for expiry
    assert holder(kube_cluster, kube_namespace) == "b"


class Interleaved(LeaderElector):
    """An elector after whose next read of the Lease a real write of it lands (``then``)."""

    then: Callable[[], object] | None = None

    def _get(self) -> dict[str, Any] | None:
        lease = super()._get()
        then, self.then = self.then, None
        if then is not None:
            then()
        return lease


def test_a_renewal_in_flight_does_not_undo_the_release(kube_cluster: ControlPlane, kube_namespace: str) -> None:
    """Stopping the hold loop cancels its task, not the renewal its thread is running; that
    renewal can land between the release's read and its write. The release's write then
    conflicts, and used to be dropped (with "released lease" logged): the Lease stayed held
    until it expired. Now the release is tried again on the Lease as it is."""
    settings = Settings(lease_name="lf-test", lease_namespace=kube_namespace, identity="a", lease_duration_s=2.0)
    a = Interleaved(make_api_client(str(kube_cluster.kubeconfig)), settings)
    assert a.try_acquire_or_renew()
    a.leading = True
    a.then = elector(kube_cluster, kube_namespace, "a").try_acquire_or_renew  # the renewal
    a.release()
    assert a.then is None  # the renewal did land in between
    assert holder(kube_cluster, kube_namespace) == ""
    assert elector(kube_cluster, kube_namespace, "b").try_acquire_or_renew()


@contextmanager
def adapters_not_served(cluster: ControlPlane, namespace: str) -> Iterator[None]:
    """The LoraAdapter CRD's version taken out of service (``served: false``: nothing stored is
    lost) and put back on the way out, each time until the API server answers so."""
    url = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{ADAPTERS}"

    def serve(served: bool) -> None:
        patch = [{"op": "replace", "path": "/spec/versions/0/served", "value": served}]
        cluster.kubectl("patch", "crd", f"{ADAPTERS}.{GROUP}", "--type=json", "-p", json.dumps(patch))
        wait_for(lambda: cluster.request("GET", url)[0] == (200 if served else 404), 60, f"{ADAPTERS} served={served}")

    serve(False)
    try:
        yield
    finally:
        serve(True)


def test_a_leader_whose_reconcile_loop_fails_releases_the_lease_and_exits(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    tmp_path: Path,
) -> None:
    """A real failure of kopf's loop: the resource it watches stops being served (404). kopf
    retries 403, 429 and 5xx without end (the operator's back-off policy), but a watch
    answered 404 ends its watcher and with it kopf's root task; the leader must then not keep
    renewing a Lease it does nothing with. It exits 1 by itself (the API server stays up, the
    Lease is never lost) and leaves the Lease released: holder cleared, which an expiry never
    does, so a standby takes over at once."""
    ns = kube_namespace
    op = start_operator(kube_cluster, ns, tmp_path)
    apply(kube_cluster, ns, fleet_manifest())
    # kopf's loop runs: the fleet's drift daemon wrote its status.
    wait_for(
        lambda: kube_cluster.kubectl_json("get", "lorafleet", "default", "-n", ns).get("status", {}).get("conditions"),
        60,
        "the fleet's status",
        op,
    )
    lease = "lorafleet-operator"
    assert kube_cluster.kubectl_json("get", "lease", lease, "-n", ns)["spec"]["holderIdentity"] == "op-0"
    with adapters_not_served(kube_cluster, ns):
        try:
            code = op.popen.wait(120)
        finally:
            op.stop()
    log = op.log()
    assert code == 1, log[-4000:]
    assert "kopf's reconcile loop failed; releasing the lease and exiting" in log
    assert "lost leadership" not in log
    assert kube_cluster.kubectl_json("get", "lease", lease, "-n", ns)["spec"]["holderIdentity"] == ""
    standby = start_operator(kube_cluster, ns, tmp_path, identity="op-1")
    try:
        assert "waiting for leadership" not in standby.log()
    finally:
        standby.stop()


def test_a_stopped_leader_leaves_kopf_no_task_to_wait_for(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    tmp_path: Path,
) -> None:
    """SIGTERM: kopf stops, the operator releases the Lease and exits 0, and kopf found no
    task of ours still pending (it gives such "hung" tasks 5 s before it cancels them: the
    waiter on the operator's own stop flag was one, and made every shutdown 5 s longer)."""
    ns = kube_namespace
    op = start_operator(kube_cluster, ns, tmp_path, env={"LORAFLEET_LOG_LEVEL": "DEBUG"})
    apply(kube_cluster, ns, fleet_manifest())
    wait_for(
        lambda: kube_cluster.kubectl_json("get", "lorafleet", "default", "-n", ns).get("status", {}).get("conditions"),
        60,
        "the fleet's status",
        op,
    )
    assert op.stop() == 0
    log = op.log()
    assert "Hung tasks stopping is skipped: no tasks given." in log, log[-4000:]
    assert "Hung tasks are stopped" not in log
    assert kube_cluster.kubectl_json("get", "lease", "lorafleet-operator", "-n", ns)["spec"]["holderIdentity"] == ""
