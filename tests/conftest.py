"""Fixtures for tests against a real kube-apiserver (see docs/kube-test-harness.md).

At the top of tests/ so every subsystem (tests/kube, tests/operator) shares one control plane
per session instead of starting its own.

* ``kube_bin_dir`` (session): where scripts/build-kube.sh put the binaries. A missing build
  fails the session with instructions to run the script; it is never a silent skip.
* ``kube_cluster`` (session): one etcd + kube-apiserver + kube-controller-manager for the whole
  session (a ``tests.kube.harness.ControlPlane``), every process stopped at the end.
* ``kube_namespace`` (function): a fresh namespace per test, deleted afterwards (no waiting).
* ``lorafleet_crds`` (session): the chart's CRDs applied for real and Established.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube.harness import CHECKOUT, ControlPlane, HarnessError, find_bin_dir

CRD_NAMES = ("lorafleets.lorafleet.dev", "loraadapters.lorafleet.dev")


@pytest.fixture(scope="session")
def kube_bin_dir() -> Path:
    """The directory holding etcd, kube-apiserver, kube-controller-manager, kubectl and helm."""
    try:
        return find_bin_dir(CHECKOUT)
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def kube_cluster(kube_bin_dir: Path) -> Iterator[ControlPlane]:
    """A running control plane shared by the session; every process is stopped afterwards."""
    cluster = ControlPlane.start(kube_bin_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def kube_namespace(kube_cluster: ControlPlane) -> Iterator[str]:
    """A fresh namespace for one test; deleted afterwards by the namespace controller."""
    name = kube_cluster.create_namespace()
    try:
        yield name
    finally:
        kube_cluster.delete_namespace(name)


@pytest.fixture(scope="session")
def lorafleet_crds(kube_cluster: ControlPlane) -> tuple[str, ...]:
    """The chart's CRDs applied for real (once per session) and Established; returns their names."""
    kube_cluster.kubectl("apply", "--server-side", "-f", str(CHECKOUT.crds))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{name}" for name in CRD_NAMES))
    return CRD_NAMES
