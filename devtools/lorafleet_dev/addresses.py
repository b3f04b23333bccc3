"""Addresses of their own for local processes that must look like distinct pods to the API
server: each a /32 from the benchmarking range 198.18.0.0/15 (RFC 2544, never routed on the
internet) on this machine's ``lo`` device, for as long as a test needs them.

Loopback addresses (127.0.0.0/8) would do for the processes, but the API server refuses them in
an EndpointSlice (so lorafleet's operator leaves such pods out of its slices); these it accepts.
On ``lo`` they are reachable from this machine only, as 127.0.0.1 is. Adding one needs root
(CAP_NET_ADMIN): without it :func:`local_addresses` raises a :class:`HarnessError` saying so.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import subprocess
from collections.abc import Iterator, Sequence

from lorafleet_dev.processes import HarnessError

BENCHMARK_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
DEVICE = "lo"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("ip")
    if binary is None:
        raise HarnessError("local addresses need iproute2's `ip` command on PATH (apt-get install iproute2)")
    return subprocess.run([binary, *args], capture_output=True, text=True, check=False)


def _present() -> set[str]:
    """The IPv4 addresses on :data:`DEVICE` now."""
    listed = _ip("-4", "-o", "addr", "show", "dev", DEVICE)
    if listed.returncode != 0:
        raise HarnessError(f"cannot list the addresses of {DEVICE}: {listed.stderr.strip()}")
    # One line per address: "1: lo    inet 127.0.0.1/8 scope host lo ...".
    return {fields[fields.index("inet") + 1].partition("/")[0] for fields in map(str.split, listed.stdout.splitlines()) if "inet" in fields}


def _checked(address: str) -> str:
    if ipaddress.IPv4Address(address) not in BENCHMARK_NETWORK:
        raise HarnessError(f"{address} is not in {BENCHMARK_NETWORK}: local addresses come from the benchmarking range only")
    return address


@contextlib.contextmanager
def local_addresses(addresses: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Each of ``addresses`` (from :data:`BENCHMARK_NETWORK`) on :data:`DEVICE` while the block
    runs. One already there is used as it is and left there; those added here are removed on
    the way out. A HarnessError when one cannot be added (not root: it needs CAP_NET_ADMIN)."""
    wanted = tuple(dict.fromkeys(_checked(a) for a in addresses))
    added: list[str] = []
    try:
        present = _present()
        for address in wanted:
            if address in present:
                continue
            result = _ip("addr", "add", f"{address}/32", "dev", DEVICE)
            if result.returncode != 0:
                raise HarnessError(
                    f"cannot add {address}/32 to {DEVICE}: {result.stderr.strip()} (local agents get addresses of their own "
                    f"from {BENCHMARK_NETWORK}; adding one needs root, or CAP_NET_ADMIN, on this machine)"
                )
            added.append(address)
        yield wanted
    finally:
        for address in added:
            _ip("addr", "del", f"{address}/32", "dev", DEVICE)
