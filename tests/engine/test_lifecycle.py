"""Engine processes: clear startup failures (never a hang), dead ranks, identical pool decisions."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import struct
import time

import pytest

from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.engine import AdapterLoadError, Engine, EngineConfig, EngineError, FaultPlan, SequenceInput, Topology, TopologyError

SHAPE = SyntheticModel()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("lifecycle") / "model", SHAPE)


def test_port_in_use_is_a_clear_error(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(EngineError, match="address already in use"):
            Engine(EngineConfig(model_dir=model_dir, topology=Topology(2), master_port=port, startup_timeout_s=120))


def _listening(pid: int) -> set[tuple[str, int]]:
    """The TCP (address, port) pairs process `pid` listens on, from /proc (IPv6 shown as "v6")."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # a descriptor closed while we look
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as rows:
            for row in rows.readlines()[1:]:
                local, state, inode = (row.split()[i] for i in (1, 3, 9))
                if state == "0A" and f"socket:[{inode}]" in inodes:  # 0A: LISTEN
                    address, port = local.split(":")
                    shown = socket.inet_ntoa(bytes.fromhex(address)[::-1]) if table == "tcp" else "v6"
                    found.add((shown, int(port, 16)))
    return found


def _outward_interfaces() -> list[str]:
    """Interfaces other than loopback that have an IPv4 address."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # SIOCGIFADDR fails for an interface without one
                fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()))
                found.append(name)
    return [name for name in found if name != "lo"]


def test_ranks_meet_at_a_store_the_driver_holds_and_listen_on_loopback_only(model_dir, monkeypatch):
    # gloo listens where GLOO_SOCKET_IFNAME or the host name points: name an interface that is
    # not loopback, as a pod's host name resolves to the pod's IP.
    outward = _outward_interfaces()
    if outward:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", outward[0])
    before = _listening(os.getpid())
    engine = Engine(EngineConfig(model_dir=model_dir, topology=Topology(2)))
    try:
        # The driver bound the rendezvous before any rank started (no other process can take
        # the port in between), on loopback.
        rendezvous = _listening(os.getpid()) - before
        assert [address for address, _ in rendezvous] == ["127.0.0.1"], rendezvous
        for pid in engine.pids:
            ranks = _listening(pid)
            assert ranks and {address for address, _ in ranks} == {"127.0.0.1"}, (pid, ranks)
    finally:
        engine.close()
    assert _listening(os.getpid()) - before == set()


def test_a_rank_that_cannot_start_ends_startup_with_its_reason(model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    # A checkpoint that lacks most tensors: every rank fails while reading its slices.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]}, str(broken / "model.safetensors"))
    with pytest.raises(EngineError, match=r"rank \d failed to start: .*has no tensor 'lm_head.weight'"):
        Engine(EngineConfig(model_dir=broken, topology=Topology(2), startup_timeout_s=120))


def test_impossible_topologies_are_refused_before_any_rank_starts(model_dir):
    with pytest.raises(TopologyError, match="--dp 3 must divide --tp 4"):
        Topology(4, 3)
    with pytest.raises(TopologyError, match="not divisible by its TP group size 3"):
        Engine(EngineConfig(model_dir=model_dir, topology=Topology(3)))
    with pytest.raises(TopologyError, match="max_lora_rank"):
        Engine(EngineConfig(model_dir=model_dir, topology=Topology(4, fully_sharded_loras=True), max_lora_rank=6))


def test_a_killed_rank_makes_calls_fail_fast(model_dir):
    engine = Engine(EngineConfig(model_dir=model_dir, topology=Topology(2, 2)))
    try:
        assert engine.alive
        os.kill(engine.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineError, match="rank 1 exited"):
            engine.forward([SequenceInput([1, 2, 3])])
        assert not engine.alive
        with pytest.raises(EngineError, match="not serving"):
            engine.forward([SequenceInput([1, 2, 3])])
        # Bounded by the engine's detection, not by the gloo timeout (minutes).
        assert time.monotonic() - started < 60
    finally:
        engine.close()


def test_every_rank_makes_the_same_slot_decisions(model_dir, tmp_path):
    adapters = {name: write_adapter(tmp_path / name, SHAPE, rank=4, seed=i) for i, name in enumerate("abcd")}
    config = EngineConfig(model_dir=model_dir, topology=Topology(4, 2), max_loras_per_batch=2)
    with Engine(config) as engine:
        engine.load_adapter("p", adapters["d"], pinned=True)
        for name in "abc":
            result = engine.load_adapter(name, adapters[name])
            assert [r.holds[-1] for r in result.ranks] == [name] * 4, "each rank says what it holds afterwards"
        assert engine.holding("b").already_loaded and engine.holding("b").ok
        missing = engine.holding("zzz")
        assert not missing.ok and missing.error == " | ".join(f"rank {rank} does not hold 'zzz'" for rank in range(4))
        for batch in (["a"], ["b", None], ["c"], [None], ["b"], ["p", "c"], [None, "a", "p"]):
            engine.forward([SequenceInput([1, 2, 3 + i], adapter) for i, adapter in enumerate(batch)])
            resident = [dict(reply.resident) for reply in engine.describe()]
            assert all(r == resident[0] for r in resident), resident
            assert 0 in resident[0] and resident[0][0] == "p", "the pinned adapter keeps its slot"
        with pytest.raises(EngineError, match="no free LoRA slot"):
            engine.forward([SequenceInput([1], "a"), SequenceInput([2], "b")])
        # A refused batch changes nothing and the engine keeps serving.
        assert len(engine.forward([SequenceInput([1, 2], "a")])) == 1


def test_a_load_failing_on_one_rank_leaves_no_rank_holding_it(model_dir, tmp_path):
    adapter = write_adapter(tmp_path / "a", SHAPE, rank=4)
    config = EngineConfig(model_dir=model_dir, topology=Topology(2, 2))
    with Engine(config, FaultPlan(fail_load_on_rank=1)) as engine:
        with pytest.raises(AdapterLoadError, match="injected load failure on rank 1") as refused:
            engine.load_adapter("a", adapter)
        assert all(reply.holds == () for reply in engine.describe()), "rank 0 rolled back"
        assert [(r.ok, r.holds) for r in refused.value.result.ranks] == [(False, ()), (False, ())], "and says so"
        assert "a" not in engine.adapters
        with pytest.raises(EngineError, match="'a' is not loaded"):
            engine.forward([SequenceInput([1, 2], "a")])
        assert len(engine.forward([SequenceInput([1, 2])])) == 1, "the engine keeps serving"
