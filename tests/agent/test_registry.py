"""The agent registry on its own: versions, leases, drains, per-name serialisation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from node_agent.errors import AdapterNotFound
from node_agent.registry import AdapterEntry, Registry
from node_agent.sources import Content, ResolvedSource


def entry(registry: Registry, name: str, digest: str = "a") -> AdapterEntry:
    source = ResolvedSource(f"file:///r/{name}", Path(f"/r/{name}"), Content(digest * 64, "c" * 64))
    return AdapterEntry(name, registry.new_engine_name(name), source, pinned=False)


def test_each_version_gets_a_fresh_engine_name_valid_for_the_engine():
    from node_agent.validation import ADAPTER_NAME

    registry = Registry()
    names = {registry.new_engine_name("x" * 253) for _ in range(3)}
    assert len(names) == 3 and all(ADAPTER_NAME.match(n) for n in names)


def test_publish_swaps_the_version_new_leases_get_while_old_leases_keep_theirs():
    registry = Registry()
    old = entry(registry, "a")
    assert registry.publish(old) is None
    lease = registry.acquire(["a"])
    new = entry(registry, "a", "b")
    assert registry.publish(new) is old
    assert lease.engine_name("a") == old.engine_name
    assert registry.acquire(["a"]).engine_name("a") == new.engine_name
    assert registry.public_name(old.engine_name) == registry.public_name(new.engine_name) == "a"


def test_public_names_maps_in_order_each_public_name_once_and_unknown_names_stand_for_themselves():
    registry = Registry()
    a1, b = entry(registry, "a"), entry(registry, "b")
    registry.publish(a1)
    registry.publish(b)
    a2 = entry(registry, "a", "b")
    registry.publish(a2)  # a1 is still held (being retired): both versions are one name
    held = (a1.engine_name, b.engine_name, a2.engine_name, "gone.7")
    assert registry.public_names(held) == ("a", "b", "gone.7")
    assert registry.public_names(held) == tuple(dict.fromkeys(registry.public_name(n) for n in held))


def test_withdrawn_names_are_refused_at_once_with_their_state():
    registry = Registry()
    registry.publish(entry(registry, "a"))
    withdrawn = registry.withdraw("a")
    with pytest.raises(AdapterNotFound, match="'a' is being unloaded"):
        registry.acquire(["a"])
    registry.forget(withdrawn)
    with pytest.raises(AdapterNotFound, match="'a' is not loaded"):
        registry.acquire(["a"])
    with pytest.raises(AdapterNotFound):
        registry.withdraw("a")


def test_a_failed_acquire_takes_no_lease():
    registry = Registry()
    a = entry(registry, "a")
    registry.publish(a)
    with pytest.raises(AdapterNotFound):
        registry.acquire(["a", "missing"])
    assert registry.in_flight(a.engine_name) == 0


def test_wait_idle_returns_when_the_last_lease_is_released_or_at_the_bound():
    registry = Registry()
    a = entry(registry, "a")
    registry.publish(a)
    leases = [registry.acquire(["a"]), registry.acquire(["a", "a"])]
    assert registry.in_flight(a.engine_name) == 2, "one lease per request, however often it names the adapter"
    assert not registry.wait_idle(a.engine_name, 0.05)
    threading.Timer(0.05, registry.release, [leases[0]]).start()
    threading.Timer(0.1, registry.release, [leases[1]]).start()
    assert registry.wait_idle(a.engine_name, 30)
    registry.release(leases[1])  # releasing twice is harmless
    assert registry.in_flight(a.engine_name) == 0


def test_forgetting_a_version_under_a_lease_revokes_that_lease():
    registry = Registry()
    a = entry(registry, "a")
    registry.publish(a)
    lease = registry.acquire(["a"])
    registry.forget(registry.withdraw("a"))
    assert registry.revoked(lease) == ["a"]
    registry.release(lease)
    assert registry.revoked(lease) == []


def test_same_name_calls_are_serialised_and_different_names_are_not():
    registry = Registry()
    inside: dict[str, int] = {}
    peak: dict[str, int] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(2, timeout=10)

    def work(name: str, meet: bool) -> None:
        with registry.serialised(name):
            with lock:
                inside[name] = inside.get(name, 0) + 1
                peak[name] = max(peak.get(name, 0), inside[name])
            if meet:
                barrier.wait()  # only possible if the other name's call runs at the same time
            time.sleep(0.05)
            with lock:
                inside[name] -= 1

    threads = [threading.Thread(target=work, args=(n, m)) for n, m in (("x", False), ("x", False), ("y", True), ("z", True))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert peak == {"x": 1, "y": 1, "z": 1} and not barrier.broken
    assert registry._name_locks == {}, "per-name locks are dropped when unused"
