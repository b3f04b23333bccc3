"""The driver's digest check of an agent's snapshot (`files.verify_adapter`): files still
of the identities their writer recorded once it had hashed every byte (`WrittenFiles`) are taken
at their writer's digests; any other version is hashed, and refused unless its digests are the
expected ones."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.engine import ContentChanged, FileDigests, FileIdentity, WrittenFiles
from node_agent.engine.adapters.errors import CONFIG_FILE, WEIGHTS_FILE
from node_agent.engine.adapters.files import verify_adapter
from node_agent.engine.adapters.memo import SpecMemo
from node_agent.engine.model_config import ModelConfig

SHAPE = SyntheticModel()
RANK = 8


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> ModelConfig:
    return ModelConfig.from_dir(write_model(tmp_path_factory.mktemp("written") / "model", SHAPE))


@pytest.fixture
def adapter(tmp_path) -> Path:
    return write_adapter(tmp_path / "adapter", SHAPE, rank=RANK)


def digests(adapter: Path) -> FileDigests:
    return FileDigests(*(hashlib.sha256((adapter / name).read_bytes()).hexdigest() for name in (WEIGHTS_FILE, CONFIG_FILE)))


def identities(adapter: Path) -> WrittenFiles:
    return WrittenFiles(*(FileIdentity.of(os.stat(adapter / name)) for name in (WEIGHTS_FILE, CONFIG_FILE)))


def test_files_still_as_written_are_taken_at_their_writers_digests(cfg, adapter):
    # Digests that are not the files': hashing would refuse them, so a pass shows none was made.
    recorded = FileDigests("0" * 64, "1" * 64)
    verified = verify_adapter(adapter, SpecMemo(cfg, RANK), recorded, identities(adapter))
    assert verified.files.digests == recorded
    with pytest.raises(ContentChanged, match="the driver read other bytes than the agent verified"):
        verify_adapter(adapter, SpecMemo(cfg, RANK), recorded, None)


def test_a_file_written_to_since_is_hashed_and_refused_when_its_bytes_differ(cfg, adapter):
    expected, written = digests(adapter), identities(adapter)
    weights = adapter / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor: same size, same header
    weights.write_bytes(bytes(data))
    # A write in the same clock tick as the writer's last leaves mtime as it was; one a second later does not.
    later = written.weights.mtime_ns + 1_000_000_000
    os.utime(weights, ns=(later, later))
    with pytest.raises(
        ContentChanged, match=f"{WEIGHTS_FILE} has sha256 {hashlib.sha256(data).hexdigest()}, the agent verified {expected.weights_sha256}"
    ):
        verify_adapter(adapter, SpecMemo(cfg, RANK), expected, written)


def test_a_replaced_file_with_the_same_bytes_is_hashed_and_passes(cfg, adapter):
    expected, written = digests(adapter), identities(adapter)
    config = adapter / CONFIG_FILE
    replacement = adapter / "replacement"
    replacement.write_bytes(config.read_bytes())
    os.replace(replacement, config)  # another inode: not the version the writer recorded
    assert identities(adapter) != written
    assert verify_adapter(adapter, SpecMemo(cfg, RANK), expected, written).files.digests == expected
    with pytest.raises(ContentChanged):
        verify_adapter(adapter, SpecMemo(cfg, RANK), FileDigests(expected.weights_sha256, "2" * 64), written)
