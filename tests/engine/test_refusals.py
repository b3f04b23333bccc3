"""Adapters the engine must refuse (issue 2, docs/design.md §6), on one tp=2 engine.

Each refusal raises AdapterLoadError with one line naming the problem (a key phrase per case,
tests/reference.py BAD_ADAPTERS). Afterwards the engine is unchanged and still serving: the
refused name is not loaded (a forward with it raises EngineError saying so), a good adapter
loads under that very name, and a mixed forward still equals transformers + PEFT. Pickle files
(.bin, .pt) are never opened, proven with inotify.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import support as R
from tests.engine.helpers import Seq, compare, draw_tokens, engine_api

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
            api, engine, model_dir, good, good2, tmp_path_factory.mktemp("bad-adapters"),
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
        served.model_dir, served.bad_root / "decoys", seed=31, r=8, lora_alpha=16,
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
