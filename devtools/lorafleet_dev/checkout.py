"""The lorafleet repository checkout the development tooling reads files from.

The tooling is installed (editable or not), so it never guesses the repository from its own
location: the caller says where the checkout is (the tests and benchmarks know their own
path), or :meth:`Checkout.find` looks upwards from the current directory (the demo).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class CheckoutError(RuntimeError):
    """The given or current directory is not (inside) a lorafleet checkout."""


@dataclass(frozen=True)
class Checkout:
    """Paths of the repository files the tooling uses."""

    root: Path

    @property
    def chart(self) -> Path:
        """The Helm chart."""
        return self.root / "deploy" / "helm" / "lorafleet"

    @property
    def crds(self) -> Path:
        """The CRDs: the chart's ``crds/`` directory, their one source."""
        return self.chart / "crds"

    @property
    def examples(self) -> Path:
        """The example manifests (``deploy/examples/``)."""
        return self.root / "deploy" / "examples"

    @property
    def build_kube_script(self) -> Path:
        """``scripts/build-kube.sh``: builds the control-plane binaries and knows their cache."""
        return self.root / "scripts" / "build-kube.sh"

    @property
    def build_node_script(self) -> Path:
        """``scripts/build-node.sh``: builds the real node's binaries and knows their cache."""
        return self.root / "scripts" / "build-node.sh"

    def is_valid(self) -> bool:
        """Whether ``root`` holds the chart and the kube build script."""
        return (self.chart / "Chart.yaml").is_file() and self.build_kube_script.is_file()

    @classmethod
    def at(cls, root: Path) -> Checkout:
        """The checkout at ``root``; CheckoutError if it is not one."""
        checkout = cls(root.resolve())
        if not checkout.is_valid():
            raise CheckoutError(
                f"{checkout.root} is not a lorafleet checkout (no deploy/helm/lorafleet/Chart.yaml and scripts/build-kube.sh)"
            )
        return checkout

    @classmethod
    def find(cls, start: Path) -> Checkout:
        """The checkout holding ``start`` (it or a parent); CheckoutError naming what to do."""
        start = start.resolve()
        for directory in (start, *start.parents):
            checkout = cls(directory)
            if checkout.is_valid():
                return checkout
        raise CheckoutError(
            f"{start} is not inside a lorafleet checkout; run from the repository (or below it) or pass its path with --repo"
        )
