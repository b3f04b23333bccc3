"""file:// sources: the walk under the root, the private snapshot the ranks load, and the swap race.

The race test runs against the shared agent (tp=2, dp=2 rank processes) over real gRPC; the
others call `resolve_source` on real files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest

from lorafleet.v1 import agent_pb2 as pb
from node_agent.errors import SourceNotFound, SourceRefused
from node_agent.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SourcePolicy, resolve_source
from tests.agent.helpers import forward, make_adapter

WEIGHTS, CONFIG = ADAPTER_WEIGHTS, ADAPTER_CONFIG
ITERATIONS = 60


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def swapping(entry: Path, inside: Path, outside: Path) -> Iterator[list[int]]:
    """A thread that keeps replacing `entry` (atomically) by a hard link of `inside` (a real file in
    the root) and by a symlink to `outside`; yields a one-element list counting the swaps."""
    stop, swaps = threading.Event(), [0]
    real_tmp, link_tmp = entry.with_name(".swap-real"), entry.with_name(".swap-link")

    def run() -> None:
        while not stop.is_set():
            os.link(inside, real_tmp)
            os.replace(real_tmp, entry)
            os.symlink(outside, link_tmp)
            os.replace(link_tmp, entry)
            swaps[0] += 2
            stop.wait(0.0002)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield swaps
    finally:
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()


@pytest.fixture
def race_dirs(shared, tmp_path):
    """In the shared root: `race-in` (content A), `race-out-copy` (content B, for reference logits) and
    `race` (its weights entry is swapped); outside the root: `outside` (content B)."""
    root = shared.root
    for name in ("race-in", "race-out-copy", "race"):
        shutil.rmtree(root / name, ignore_errors=True)
    inside = make_adapter(root / "race-in", seed=71)
    outside = make_adapter(tmp_path / "outside", seed=72)
    shutil.copytree(outside, root / "race-out-copy")
    race = root / "race"
    race.mkdir()
    shutil.copy(inside / CONFIG, race / CONFIG)
    shutil.copy(inside / WEIGHTS, race / WEIGHTS)
    assert (inside / CONFIG).read_bytes() == (outside / CONFIG).read_bytes(), "only the weights differ"
    yield inside, outside, race
    for name in ("race-in", "race-out-copy", "race"):
        shutil.rmtree(root / name, ignore_errors=True)


def test_a_symlink_swapped_in_during_loads_never_serves_bytes_from_outside_the_root(shared, stub, race_dirs):
    inside, outside, race = race_dirs
    inside_sha, outside_sha = sha256(inside / WEIGHTS), sha256(outside / WEIGHTS)
    tokens = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46]]  # two sequences: both DP groups
    for name, directory in (("race-ref-in", inside), ("race-ref-out", shared.root / "race-out-copy")):
        assert stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=directory.as_uri()), timeout=60).success
    reference_in = forward(stub, *[(t, "race-ref-in") for t in tokens])
    reference_out = forward(stub, *[(t, "race-ref-out") for t in tokens])
    assert all(np.abs(a - b).max() > 1e-2 for a, b in zip(reference_in, reference_out, strict=True)), "the outside adapter is detectable"

    loaded, refused = 0, []
    with swapping(race / WEIGHTS, inside / WEIGHTS, outside / WEIGHTS) as swaps:
        for _ in range(ITERATIONS):
            try:
                reply = stub.LoadAdapter(pb.LoadAdapterRequest(name="race", source_uri=race.as_uri()), timeout=60)
            except grpc.RpcError as error:
                assert (error.code(), "symlink" in error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, True), error.details()
                refused.append(error.details())
                continue
            assert reply.success, reply.error_message
            listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}
            assert listed["race"].sha256 == inside_sha != outside_sha
            assert list(listed["race"].ranks) == list(listed["race-ref-in"].ranks), "every rank holds it"
            served = forward(stub, *[(t, "race") for t in tokens])
            for got, want in zip(served, reference_in, strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            loaded += 1
            assert stub.UnloadAdapter(pb.UnloadAdapterRequest(name="race"), timeout=60).success
    assert swaps[0] > ITERATIONS, "the entry was swapped while the loads ran"
    assert loaded > 0, f"no load succeeded among {ITERATIONS} ({refused[:3]})"
    # Snapshots live only as long as their version: the two references are all that is left.
    assert len(list(shared.cache.glob("snap-*"))) == 2


# -- the walk and the snapshot, in-process ----------------------------------------------------------


def policy_for(root: Path, tmp_path: Path) -> SourcePolicy:
    return SourcePolicy(adapter_roots=(root,), cache_dir=tmp_path / "cache")


def test_the_ranks_get_a_private_snapshot_of_the_checked_bytes(tmp_path):
    root = tmp_path / "root"
    adapter = make_adapter(root / "ad", seed=1)
    policy = policy_for(root, tmp_path)
    source = resolve_source(adapter.as_uri(), None, policy)
    assert source.path.parent == policy.cache_dir and source.path.name.startswith("snap-")
    assert stat.S_IMODE(source.path.stat().st_mode) == 0o700
    for name in (CONFIG, WEIGHTS):
        assert (source.path / name).read_bytes() == (adapter / name).read_bytes()
    assert source.content.weights_sha256 == sha256(source.path / WEIGHTS)
    assert source.content.config_sha256 == sha256(source.path / CONFIG)
    (adapter / WEIGHTS).write_bytes(b"changed under the root afterwards")
    assert sha256(source.path / WEIGHTS) == source.content.weights_sha256
    source.discard()
    assert not source.path.exists() and adapter.exists(), "discard removes the snapshot, never the source"


def test_without_a_cache_dir_snapshots_go_to_a_private_temp_dir(tmp_path):
    adapter = make_adapter(tmp_path / "root" / "ad", seed=1)
    source = resolve_source(adapter.as_uri(), None, SourcePolicy(adapter_roots=(tmp_path / "root",)))
    try:
        assert not source.path.is_relative_to(tmp_path) and stat.S_IMODE(source.path.stat().st_mode) == 0o700
        assert (source.path / WEIGHTS).read_bytes() == (adapter / WEIGHTS).read_bytes()
    finally:
        source.discard()
    assert not source.path.exists()


@contextmanager
def relinking(entry: Path, inside: str, outside: Path) -> Iterator[None]:
    """A thread that keeps replacing the symlink `entry` by one to `inside` (relative, in the root)
    and one to `outside`."""
    stop = threading.Event()
    tmp = entry.with_name(".relink")

    def run() -> None:
        while not stop.is_set():
            for target in (inside, str(outside)):
                os.symlink(target, tmp)
                os.replace(tmp, entry)
            stop.wait(0.0002)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


@pytest.mark.parametrize("swapped", ["weights-file", "directory-link"])
def test_a_swapping_entry_gives_the_in_root_bytes_or_a_refusal(tmp_path, swapped):
    root = tmp_path / "root"
    inside = make_adapter(root / "in", seed=1)
    outside = make_adapter(tmp_path / "outside", seed=2)
    policy = policy_for(root, tmp_path)
    outcomes = {"loaded": 0, "refused": 0}
    if swapped == "weights-file":
        race = root / "race"
        shutil.copytree(inside, race)
        swapper = swapping(race / WEIGHTS, inside / WEIGHTS, outside / WEIGHTS)
    else:  # an in-root symlink to the adapter directory, re-pointed out of the root and back
        race = root / "current"
        race.symlink_to("in")
        swapper = relinking(race, "in", outside)
    with swapper:
        for _ in range(200):
            try:
                source = resolve_source(race.as_uri(), None, policy)
            except SourceRefused as refused:
                assert refused.reason in ("symlink_escape", "symlink_loop"), refused
                outcomes["refused"] += 1
                continue
            assert (source.path / WEIGHTS).read_bytes() == (inside / WEIGHTS).read_bytes()
            assert source.content.weights_sha256 == sha256(inside / WEIGHTS)
            source.discard()
            outcomes["loaded"] += 1
    assert outcomes["loaded"] > 0, outcomes
    assert not list(policy.cache_dir.iterdir())


def test_kubernetes_style_relative_symlinks_inside_the_root_are_followed(tmp_path):
    # A ConfigMap/Secret volume: ..2026_x/ holds the data, ..data -> ..2026_x, each entry -> ..data/entry.
    root = tmp_path / "volume"
    adapter = make_adapter(root / "..2026_12_01" / "ad", seed=1)
    (root / "..data").symlink_to("..2026_12_01")
    (root / "ad").symlink_to("..data/ad")
    flat = root / "flat"
    flat.mkdir()
    for name in (CONFIG, WEIGHTS):
        (flat / name).symlink_to(f"../..data/ad/{name}")
    for uri in ((root / "ad").as_uri(), flat.as_uri()):
        source = resolve_source(uri, None, policy_for(root, tmp_path))
        assert source.content.weights_sha256 == sha256(adapter / WEIGHTS)
        source.discard()


def test_symlinks_that_climb_out_of_the_root_or_loop_are_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    make_adapter(tmp_path / "outside", seed=2)
    (root / "up").symlink_to("../outside")
    (root / "loop").symlink_to("loop")
    inner = root / "inner"
    inner.mkdir()
    (inner / "deep-up").symlink_to("../../outside")
    policy = policy_for(root, tmp_path)
    for name, reason in (("up", "symlink_escape"), ("inner/deep-up", "symlink_escape"), ("loop", "symlink_loop")):
        with pytest.raises(SourceRefused, match="symlink") as refused:
            resolve_source((root / name).as_uri(), None, policy)
        assert refused.value.reason == reason
    assert not list(policy.cache_dir.glob("snap-*"))


def test_the_config_cap_applies_to_file_sources(tmp_path):
    root = tmp_path / "root"
    adapter = make_adapter(root / "ad", seed=1)
    with open(adapter / CONFIG, "r+b") as handle:
        handle.truncate(50 << 20)  # 50 MB (sparse: cheap to write, and never read whole)
    policy = policy_for(root, tmp_path)
    with pytest.raises(SourceRefused, match=r"adapter_config.json .* over the 1048576-byte cap") as refused:
        resolve_source(adapter.as_uri(), None, policy)
    assert refused.value.reason == "too_large"
    assert not list(policy.cache_dir.glob("snap-*"))


def test_the_weights_cap_applies_to_file_sources(tmp_path):
    root = tmp_path / "root"
    adapter = make_adapter(root / "ad", seed=1)
    size = (adapter / WEIGHTS).stat().st_size
    with pytest.raises(SourceRefused, match="cap") as refused:
        resolve_source(adapter.as_uri(), None, SourcePolicy(adapter_roots=(root,), max_download_bytes=size - 1))
    assert refused.value.reason == "too_large"


def test_a_fifo_or_file_where_the_directory_should_be_says_what_it_is(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "fifo")
    (root / "plain").write_bytes(b"not a directory")
    policy = policy_for(root, tmp_path)
    for name, kind in (("fifo", "a FIFO"), ("plain", "a regular file")):
        with pytest.raises(SourceRefused, match=f"is {kind}, not a directory") as refused:
            resolve_source((root / name).as_uri(), None, policy)
        assert refused.value.reason == "not_a_directory"
    with pytest.raises(SourceNotFound, match="does not exist"):
        resolve_source((root / "missing").as_uri(), None, policy)


def test_a_fifo_where_a_file_should_be_is_refused_without_blocking(tmp_path):
    root = tmp_path / "root"
    adapter = make_adapter(root / "ad", seed=1)
    (adapter / WEIGHTS).unlink()
    os.mkfifo(adapter / WEIGHTS)  # nobody ever writes to it: opening it for reading would block
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            resolve_source(adapter.as_uri(), None, policy_for(root, tmp_path))
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():  # unblock the reader so the test process can end
        os.close(os.open(adapter / WEIGHTS, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("resolving a FIFO blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], SourceRefused), outcome
    assert "is a FIFO, not a regular file" in str(outcome[0]) and outcome[0].reason == "not_a_file"


def test_file_uris_with_a_host_say_that_hosts_are_not_supported(tmp_path):
    make_adapter(tmp_path / "root" / "ad", seed=1)
    policy = policy_for(tmp_path / "root", tmp_path)
    with pytest.raises(SourceRefused, match="hosts are not supported") as refused:
        resolve_source(f"file://otherhost{tmp_path}/root/ad", None, policy)
    assert refused.value.reason == "file_host"
    source = resolve_source(f"file://localhost{tmp_path}/root/ad", None, policy)  # RFC 8089: localhost is local
    source.discard()
