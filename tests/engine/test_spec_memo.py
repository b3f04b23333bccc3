"""The driver's spec memo (`memo.SpecMemo`, used by `files.verify_adapter`): bytes
validated once are not parsed again, whichever adapter they come from; a config new to it is
validated, and beside a header it has seen, with the fields matching reads equal, reuses that
spec; other bytes are parsed anew; a refusal is made, with its message, every time.

Adapters trained by one recipe (same rank, targets and shapes) have byte-equal safetensors
headers and configs that are byte-equal or differ in fields the engine does not read;
`Engine.load_adapter` of the second one skips the header parse and the matching.
What the engine then serves is checked numerically by test_equivalence (several adapters of one
recipe in one engine) and test_refusals (a non-finite adapter has a good adapter's header).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.engine.adapters.errors import CONFIG_FILE, WEIGHTS_FILE, AdapterLoadError
from node_agent.engine.adapters.files import verify_adapter
from node_agent.engine.adapters.memo import SpecMemo
from node_agent.engine.adapters.spec import read_adapter_spec
from node_agent.engine.model_config import ModelConfig

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


def with_config(source: Path, target: Path, **fields: object) -> Path:
    """A copy of the adapter in `source` whose config has `fields` set (None: removed)."""
    shutil.copytree(source, target)
    config = json.loads((source / CONFIG_FILE).read_text())
    config.update(fields)
    (target / CONFIG_FILE).write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=1))
    return target


def test_a_config_that_differs_only_in_fields_the_engine_does_not_read_reuses_the_spec(model, tmp_path):
    cfg, _ = model
    first = write_adapter(tmp_path / "first", SHAPE, rank=4)
    other = with_config(first, tmp_path / "other", revision="v2", base_model_name_or_path="elsewhere/model", task_type=None)
    memo = SpecMemo(cfg, MAX_RANK)
    known, again = verify_adapter(first, memo, None).spec, verify_adapter(other, memo, None).spec
    assert again.modules is known.modules and again.content == known.content, "one spec for both configs"
    assert again.path == other
    assert again.modules == read_adapter_spec(other, cfg, MAX_RANK).modules


@pytest.mark.parametrize(
    "field, value, refused",
    [
        ("lora_alpha", 2.0, None),
        ("use_rslora", True, None),
        ("alpha_pattern", {"q_proj": 2.0}, None),
        ("rank_pattern", {"q_proj": 2}, "rank"),  # the tensors have rank 4
        ("target_modules", ["q_proj", "v_proj"], "does not select"),  # the header has every module
        ("exclude_modules", ["down_proj"], "does not select"),
        ("layers_to_transform", [0], "does not select"),  # the header has every layer
    ],
)
def test_a_config_that_differs_in_a_field_matching_reads_is_matched_anew(model, tmp_path, field, value, refused):
    cfg, _ = model
    first = write_adapter(tmp_path / "first", SHAPE, rank=4, alpha=8.0)
    other = with_config(first, tmp_path / "other", **{field: value})
    memo = SpecMemo(cfg, MAX_RANK)
    known = verify_adapter(first, memo, None).spec
    if refused:
        with pytest.raises(AdapterLoadError, match=refused):
            verify_adapter(other, memo, None)
        return
    again = verify_adapter(other, memo, None).spec
    assert again.content != known.content
    assert again.modules == read_adapter_spec(other, cfg, MAX_RANK).modules != known.modules


def test_a_new_config_is_validated_even_beside_a_known_header(model, tmp_path):
    cfg, _ = model
    first = write_adapter(tmp_path / "first", SHAPE, rank=4)
    memo = SpecMemo(cfg, MAX_RANK)
    verify_adapter(first, memo, None)
    dora = with_config(first, tmp_path / "dora", use_dora=True)
    with pytest.raises(AdapterLoadError, match="use_dora"):
        verify_adapter(dora, memo, None)
    wrong = with_config(first, tmp_path / "wrong", bias=5)
    with pytest.raises(AdapterLoadError, match="bias"):
        verify_adapter(wrong, memo, None)


def test_a_header_new_to_the_memo_is_parsed_anew(model, tmp_path):
    cfg, _ = model
    first = write_adapter(tmp_path / "first", SHAPE, rank=4)
    other = tmp_path / "other"
    shutil.copytree(first, other)
    save_file(load_file(first / WEIGHTS_FILE), other / WEIGHTS_FILE, metadata={"format": "pt", "run": "2"})
    memo = SpecMemo(cfg, MAX_RANK)
    known, again = verify_adapter(first, memo, None).spec, verify_adapter(other, memo, None).spec
    assert again.content != known.content and again.modules is not known.modules
    assert again.modules == known.modules
