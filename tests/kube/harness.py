"""What the control-plane tests use: the local control plane (:mod:`lorafleet_dev.controlplane`)
and the checkout under test, whose chart, CRDs, examples and kube build script they read.

See docs/kube-test-harness.md.
"""

from pathlib import Path

from lorafleet_dev.checkout import Checkout
from lorafleet_dev.controlplane import ControlPlane, KubectlError, find_bin_dir
from lorafleet_dev.processes import HarnessError, free_port

#: The repository these tests belong to.
CHECKOUT = Checkout.at(Path(__file__).resolve().parents[2])

__all__ = ["CHECKOUT", "ControlPlane", "HarnessError", "KubectlError", "find_bin_dir", "free_port"]
