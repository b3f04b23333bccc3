"""The driver's spec memo (`peft_adapter.SpecMemo`, used by `adapter_files.verify_adapter`): bytes
validated once are not parsed again, whichever adapter they come from; other bytes are; a
refusal is made, with its message, every time.

Adapters trained by one recipe (same rank, targets and shapes) have byte-equal configs and
safetensors headers; `Engine.load_adapter` of the second one skips the parse and the matching.
What the engine then serves is checked numerically by test_equivalence (several adapters of one
recipe in one engine) and test_refusals (a non-finite adapter has a good adapter's header).
"""

from __future__ import annotations

import shutil

import pytest

from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.engine.adapter_files import verify_adapter
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.peft_adapter import CONFIG_FILE, AdapterLoadError, SpecMemo, read_adapter_spec

SHAPE = SyntheticModel()
MAX_RANK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-memo")
    return ModelConfig.from_dir(write_model(root / "model", SHAPE)), root


def test_adapters_of_one_recipe_are_parsed_once(model, tmp_path):
    cfg, _ = model
    first_dir, second_dir = (write_adapter(tmp_path / f"seed{seed}", SHAPE, rank=4, seed=seed) for seed in (0, 1))
    memo = SpecMemo(cfg, MAX_RANK)
    first, second = verify_adapter(first_dir, memo, None), verify_adapter(second_dir, memo, None)
    assert first.spec.content and first.spec.content == second.spec.content
    assert second.spec.modules is first.spec.modules, "the second adapter's spec is the remembered one"
    assert (second.spec.path, second.files.path) == (second_dir, second_dir)
    assert second.spec.modules == read_adapter_spec(second_dir, cfg, MAX_RANK).modules


def test_other_bytes_are_parsed_anew(model, tmp_path):
    cfg, _ = model
    adapter = write_adapter(tmp_path / "a", SHAPE, rank=4, alpha=8.0)
    memo = SpecMemo(cfg, MAX_RANK)
    before = verify_adapter(adapter, memo, None).spec
    # The same directory, rewritten with another alpha and then another rank: the memo is
    # keyed by the bytes, never by the path.
    write_adapter(adapter, SHAPE, rank=4, alpha=16.0)
    alpha = verify_adapter(adapter, memo, None).spec
    assert alpha.content != before.content
    assert {m.scale for m in alpha.modules} == {4.0} and {m.scale for m in before.modules} == {2.0}
    write_adapter(adapter, SHAPE, rank=2, alpha=16.0)
    assert {m.rank for m in verify_adapter(adapter, memo, None).spec.modules} == {2}


def test_a_refusal_is_made_every_time_and_never_remembered(model, tmp_path):
    cfg, _ = model
    good = write_adapter(tmp_path / "good", SHAPE, rank=4)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    config = (good / CONFIG_FILE).read_text()
    (bad / CONFIG_FILE).write_text(config.replace('"r": 4', '"r": 2'))
    memo = SpecMemo(cfg, MAX_RANK)
    verify_adapter(good, memo, None)
    for _ in range(2):
        with pytest.raises(AdapterLoadError, match=r"tensors have rank 4 but adapter_config\.json gives r=2"):
            verify_adapter(bad, memo, None)
    (bad / CONFIG_FILE).write_text(config)  # now byte-equal to the good adapter
    assert verify_adapter(bad, memo, None).spec.content == verify_adapter(good, memo, None).spec.content
