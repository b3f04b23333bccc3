"""Adapters the engine must refuse (docs/engine.md, "Adapter refusals"), on one tp=2 engine.

Each refusal raises AdapterLoadError with one line naming the problem (a key phrase per case,
tests/reference.py BAD_ADAPTERS). Afterwards the engine is unchanged and still serving: the
refused name is not loaded (a forward with it raises EngineError saying so), a good adapter
loads under that very name, and a mixed forward still equals transformers + PEFT. Pickle files
(.bin, .pt) are never opened, proven with inotify.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import support as R
from tests.engine.helpers import Seq, compare, draw_tokens, engine_api
from tests.support import bad_adapters as B
from tests.support.models import adapter_config

MODEL = "llama"  # untied (modules_to_save=["lm_head"] is meaningful), kv=2, multi-file checkpoint
MAX_LORA_RANK = 16


@dataclass
class Served:
    api: Any
    engine: Any
    model_dir: Path
    good: Path  # loaded as "good" for the whole module
    good2: Path  # loaded under each refused name afterwards
    bad_root: Path
    vocab: int


@pytest.fixture(scope="module")
def served(artifacts, tmp_path_factory):
    api = engine_api()
    model_dir = artifacts.model(MODEL)
    good = artifacts.adapter(MODEL, "standard", "all_list")
    good2 = artifacts.adapter(MODEL, "standard", "rslora_patterns")
    config = api.EngineConfig(
        model_dir=model_dir,
        topology=api.Topology(tp_size=2, dp_size=1, fully_sharded_loras=False),
        max_lora_rank=MAX_LORA_RANK,
        max_loras_per_batch=4,
        max_loaded_loras=16,
        device="cpu",
    )
    with api.Engine(config) as engine:
        engine.load_adapter("good", good, pinned=False)
        yield Served(
            api,
            engine,
            model_dir,
            good,
            good2,
            tmp_path_factory.mktemp("bad-adapters"),
            R.model_config(model_dir)["vocab_size"],
        )


def _seq_inputs(served: Served, seqs: list[Seq]):
    return [served.api.SequenceInput(tokens=s.tokens, adapter=s.adapter) for s in seqs]


def assert_not_loaded(served: Served, name: str) -> None:
    seqs = [Seq(draw_tokens(1, 3, served.vocab), name)]
    with pytest.raises(served.api.EngineError) as info:
        served.engine.forward(_seq_inputs(served, seqs))
    message = str(info.value)
    assert "not loaded" in message.lower() and name in message, message


def assert_still_serving(served: Served, name: str) -> None:
    """A good adapter loads under `name`; a batch using it, the module's "good" adapter and the
    base model equals the reference; then `name` is unloaded again."""
    served.engine.load_adapter(name, served.good2, pinned=False)
    seqs = [
        Seq(draw_tokens(2, 5, served.vocab), name),
        Seq(draw_tokens(3, 4, served.vocab), "good"),
        Seq(draw_tokens(4, 3, served.vocab), None),
    ]
    got = served.engine.forward(_seq_inputs(served, seqs))
    want = R.reference_logits(served.model_dir, seqs, {name: served.good2, "good": served.good})
    compare(got, want, seqs).fail_if_any(f"forward after refusing {name!r}")
    served.engine.unload_adapter(name)
    assert_not_loaded(served, name)


@pytest.mark.parametrize("case", sorted(R.BAD_ADAPTERS))
def test_refused_and_engine_still_serves(served: Served, case: str):
    factory, phrase = R.BAD_ADAPTERS[case]
    bad_dir = factory(served.model_dir, served.bad_root / case)
    name = f"bad-{case}"
    pickles = sorted(p for p in bad_dir.iterdir() if p.suffix in (".bin", ".pt"))

    with R.FileOpenWatcher(pickles) as watcher, pytest.raises(served.api.AdapterLoadError) as info:
        served.engine.load_adapter(name, bad_dir, pinned=False)
    message = str(info.value)
    assert phrase in message.lower(), f"{case}: message lacks {phrase!r}: {message!r}"
    assert message.strip() and "\n" not in message.strip(), f"{case}: want one line, got {message!r}"
    assert not watcher.opened, f"{case}: the loader opened pickle file(s) {sorted(map(str, watcher.opened))}"

    assert_not_loaded(served, name)
    assert_still_serving(served, name)


def test_pickle_next_to_safetensors_is_never_opened(served: Served):
    """A directory with a valid adapter_model.safetensors plus adapter_model.bin (garbage) and
    adapter_model.pt (a pickle that would create a marker directory) loads from safetensors;
    neither pickle is opened by any process."""
    adapter_dir, decoys, marker = R.make_adapter_with_pickle_decoys(
        served.model_dir,
        served.bad_root / "decoys",
        seed=31,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"],
    )
    with R.FileOpenWatcher(decoys) as watcher:
        served.engine.load_adapter("decoys", adapter_dir, pinned=False)
    assert not watcher.opened, f"opened {sorted(map(str, watcher.opened))}"
    assert not marker.exists(), "a pickle was unpickled"
    try:
        seqs = [Seq(draw_tokens(5, 6, served.vocab), "decoys"), Seq(draw_tokens(6, 2, served.vocab), None)]
        got = served.engine.forward(_seq_inputs(served, seqs))
        want = R.reference_logits(served.model_dir, seqs, {"decoys": adapter_dir})
        compare(got, want, seqs).fail_if_any("adapter loaded next to pickle decoys")
    finally:
        served.engine.unload_adapter("decoys")
    assert_not_loaded(served, "decoys")


def test_never_loaded_name_is_refused_by_forward(served: Served):
    assert_not_loaded(served, "never-loaded")


def test_good_adapter_unaffected_by_all_refusals(served: Served):
    """Runs after the refusals (file order): the module's first adapter still equals the reference."""
    seqs = [Seq(draw_tokens(7, 7, served.vocab), "good"), Seq(draw_tokens(8, 1, served.vocab), None)]
    got = served.engine.forward(_seq_inputs(served, seqs))
    want = R.reference_logits(served.model_dir, seqs, {"good": served.good})
    compare(got, want, seqs).fail_if_any("'good' after all refusals")


# --- adapter_config.json validated against a schema, numbers, patterns, duplicates, dtypes


@pytest.mark.parametrize("case", sorted(B.MALFORMED_ADAPTERS))
def test_malformed_adapter_refused_naming_the_field(served: Served, case: str):
    """Each refusal is one line naming the field (or both keys of a module given twice); the
    engine then still serves. Before the schema these were raw Python errors (RecursionError,
    AttributeError, ValueError), or loads: NaN alpha, a 1 MiB+ config, `layers.01` beside `layers.1`."""
    factory, phrases = B.MALFORMED_ADAPTERS[case]
    bad_dir = factory(served.model_dir, served.bad_root / case)
    name = f"bad-{case}"
    with pytest.raises(served.api.AdapterLoadError) as info:
        served.engine.load_adapter(name, bad_dir, pinned=False)
    message = str(info.value)
    missing = [phrase for phrase in phrases if phrase not in message.lower()]
    assert not missing, f"{case}: message lacks {missing}: {message!r}"
    assert message.strip() and "\n" not in message.strip() and len(message) < 1000, f"{case}: want one short line, got {message!r}"
    assert_not_loaded(served, name)
    assert_still_serving(served, name)


@pytest.mark.parametrize("case", ["lora_alpha_nan", "config_deeply_nested", "rank_pattern_backreference", "r_zero"])
def test_read_adapter_config_refuses_alone(served: Served, case: str):
    """The agent can validate a snapshot's config before the engine's lock: `read_adapter_config`
    needs no engine and refuses with the very message the ranks give."""
    factory, _ = B.MALFORMED_ADAPTERS[case]
    bad_dir = factory(served.model_dir, served.bad_root / f"alone-{case}")
    with pytest.raises(served.api.AdapterLoadError) as alone:
        served.api.read_adapter_config(bad_dir)
    with pytest.raises(served.api.AdapterLoadError) as loaded:
        served.engine.load_adapter(f"alone-{case}", bad_dir, pinned=False)
    assert str(alone.value) == str(loaded.value)


@pytest.mark.parametrize("case", ["duplicate_module_layer_01", "target_modules_regex_unselected", "rank_pattern_zero"])
def test_validate_adapter_refuses_alone(served: Served, case: str):
    """`validate_adapter` runs every check of the ranks (config, header, modules, patterns) in the
    caller's process, from the model directory: the same message as the engine's refusal."""
    factory, _ = B.MALFORMED_ADAPTERS[case]
    bad_dir = factory(served.model_dir, served.bad_root / f"validate-{case}")
    with pytest.raises(served.api.AdapterLoadError) as alone:
        served.api.validate_adapter(bad_dir, served.model_dir, MAX_LORA_RANK)
    with pytest.raises(served.api.AdapterLoadError) as loaded:
        served.engine.load_adapter(f"validate-{case}", bad_dir, pinned=False)
    assert str(alone.value) == str(loaded.value)
    spec = served.api.validate_adapter(served.good2, served.model_dir, MAX_LORA_RANK)
    assert spec.modules and spec.max_module_rank <= MAX_LORA_RANK


def test_read_adapter_config_reads_a_good_config(served: Served, tmp_path: Path):
    """A PEFT config reads into its fields; a config of exactly MAX_CONFIG_BYTES is accepted, one byte more is not."""
    config = served.api.read_adapter_config(served.good2)
    raw = adapter_config(served.good2)
    assert (config.r, config.lora_alpha, config.use_rslora) == (raw["r"], raw["lora_alpha"], bool(raw.get("use_rslora")))
    assert [p.key for p in config.rank_pattern] == list(raw.get("rank_pattern") or {})
    cap = served.api.MAX_CONFIG_BYTES
    assert cap == 1 << 20
    adapter = B.make_bad_config_adapter(served.model_dir, tmp_path / "at-cap")
    text = (adapter / "adapter_config.json").read_text().rstrip()
    (adapter / "adapter_config.json").write_text(text + " " * (cap - len(text.encode())))
    assert served.api.read_adapter_config(adapter).r == 4
    (adapter / "adapter_config.json").write_text(text + " " * (cap + 1 - len(text.encode())))
    with pytest.raises(served.api.AdapterLoadError, match="over the 1048576-byte cap"):
        served.api.read_adapter_config(adapter)


@pytest.mark.timeout(60)
def test_catastrophic_patterns_are_matched_in_linear_time(served: Served):
    """`([\\w.]+)+x` as rank_pattern / alpha_pattern key and inside a string target_modules:
    Python's re backtracks exponentially on every module name (the load held the engine for
    300 s); RE2 matches in linear time. The patterns change nothing, so the adapter serves
    exactly what its clean copy (the reference; PEFT would hang on the patterns) serves."""
    evil, clean = B.make_catastrophic_pattern_adapter(
        served.model_dir, served.bad_root / "catastrophic", served.bad_root / "catastrophic-clean"
    )
    served.engine.load_adapter("catastrophic", evil, pinned=False)
    try:
        seqs = [Seq(draw_tokens(9, 6, served.vocab), "catastrophic"), Seq(draw_tokens(10, 3, served.vocab), "good")]
        got = served.engine.forward(_seq_inputs(served, seqs))
        want = R.reference_logits(served.model_dir, seqs, {"catastrophic": clean, "good": served.good})
        compare(got, want, seqs).fail_if_any("adapter with catastrophic patterns")
    finally:
        served.engine.unload_adapter("catastrophic")
    assert_not_loaded(served, "catastrophic")


@pytest.mark.parametrize("shape", [[True, 16], [16.0, 16], [-1, 16], [[16], 16], "16"], ids=repr)
def test_a_header_shape_not_of_non_negative_integers_is_refused(served: Served, shape: object):
    """A tensor whose header shape is not a list of non-negative integers (a bool is none) is
    refused by name, before its offsets are compared with it (no refusal test covered this
    per-entry check of the driver's validation)."""
    bad_dir = served.bad_root / f"shape-{shape!r}"
    shutil.copytree(served.good, bad_dir)
    weights = bad_dir / "adapter_model.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    key = min(k for k in header if k != "__metadata__")
    header[key]["shape"] = shape
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    with pytest.raises(served.api.AdapterLoadError) as info:
        served.engine.load_adapter("bad-shape", bad_dir, pinned=False)
    assert str(info.value) == f"adapter_model.safetensors is corrupt or truncated: tensor {key!r} has no valid shape"
    assert_not_loaded(served, "bad-shape")
