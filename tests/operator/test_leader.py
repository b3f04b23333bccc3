"""Leader election on a real Lease: one leader at a time, takeover after expiry or release."""

from __future__ import annotations

import time

from lorafleet_operator.config import Settings
from lorafleet_operator.kube import make_api_client
from lorafleet_operator.leader import LeaderElector
from tests.kube.harness import ControlPlane


def elector(cluster: ControlPlane, namespace: str, identity: str) -> LeaderElector:
    settings = Settings(lease_name="lf-test", lease_namespace=namespace, identity=identity,
                        lease_duration_s=2.0)
    return LeaderElector(make_api_client(str(cluster.kubeconfig)), settings)


def holder(cluster: ControlPlane, namespace: str) -> str:
    lease = cluster.kubectl_json("get", "lease", "lf-test", "-n", namespace)
    return str(lease["spec"].get("holderIdentity") or "")


def test_one_leader_then_takeover_after_expiry(
    kube_cluster: ControlPlane, kube_namespace: str
) -> None:
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
