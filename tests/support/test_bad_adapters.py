"""Self-checks of tests/support/bad_adapters.py: each factory produces the defect it names."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lorafleet_dev.synthetic import ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_key
from tests.support.bad_adapters import BAD_ADAPTERS, make_adapter_with_pickle_decoys, make_corrupt_header_adapter
from tests.support.models import adapter_config, adapter_tensors


def _readable(path) -> bool:
    """Whether every tensor of the safetensors file at ``path`` can be read."""
    try:
        load_file(str(path))
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class Made:
    """A bad adapter as its factory made it (`case` of BAD_ADAPTERS), and the base model it was made for."""

    case: str
    dir: Path
    base: Path

    @property
    def files(self) -> set[str]:
        return {p.name for p in self.dir.iterdir()}

    @property
    def weights(self) -> Path:
        return self.dir / ADAPTER_WEIGHTS

    @property
    def cfg(self) -> dict[str, Any] | None:
        return adapter_config(self.dir) if (self.dir / ADAPTER_CONFIG).exists() else None


def _dora(m: Made) -> None:
    assert m.cfg["use_dora"] is True
    assert any(k.endswith("lora_magnitude_vector") for k in adapter_tensors(m.dir))


def _modules_to_save(m: Made) -> None:
    assert m.cfg["modules_to_save"] == ["lm_head"]
    assert "base_model.model.lm_head.weight" in adapter_tensors(m.dir)


def _bias(m: Made) -> None:
    assert m.cfg["bias"] == m.case.removeprefix("bias_")


def _lora_bias(m: Made) -> None:
    assert m.cfg["lora_bias"] is True
    assert any(k.endswith("lora_B.bias") for k in adapter_tensors(m.dir))


def _rank_too_big(m: Made) -> None:
    assert m.cfg["r"] == 32 and adapter_tensors(m.dir)[lora_key(0, "q_proj", "A")].shape[0] == 32


def _rank_pattern_too_big(m: Made) -> None:
    assert m.cfg["r"] == 4 and m.cfg["rank_pattern"] == {"v_proj": 32}
    assert adapter_tensors(m.dir)[lora_key(0, "v_proj", "A")].shape[0] == 32


def _other_base(m: Made) -> None:
    assert m.cfg["base_model_name_or_path"] == str(m.base)
    assert adapter_tensors(m.dir)[lora_key(0, "q_proj", "A")].shape == (4, 96)


def _unknown_module_name(m: Made) -> None:
    assert any(".c_attn." in k for k in adapter_tensors(m.dir)) and "c_attn" in m.cfg["target_modules"]


def _unknown_module_layer(m: Made) -> None:
    assert any(".layers.7." in k for k in adapter_tensors(m.dir))


def _missing_config(m: Made) -> None:
    assert ADAPTER_CONFIG not in m.files and m.weights.is_file()


def _missing_weights(m: Made) -> None:
    assert ADAPTER_WEIGHTS not in m.files and m.cfg is not None


def _unreadable(m: Made) -> None:
    assert m.weights.is_file() and not _readable(m.weights)


def _not_finite(m: Made) -> None:
    bad = [k for k, t in adapter_tensors(m.dir).items() if not torch.isfinite(t).all()]
    assert len(bad) == 1, bad


def _pickle_only(m: Made) -> None:
    assert ADAPTER_WEIGHTS not in m.files and "adapter_model.bin" in m.files
    assert set(torch.load(m.dir / "adapter_model.bin", weights_only=True)) >= {lora_key(0, "q_proj", "A")}


#: Each case's self-check: what its defect looks like in the files (`truncated*` and `corrupt*`:
#: the weights cannot be read).
SELF_CHECKS: dict[str, Callable[[Made], None]] = {
    "dora": _dora,
    "modules_to_save": _modules_to_save,
    "bias_all": _bias,
    "bias_lora_only": _bias,
    "lora_bias": _lora_bias,
    "rank_too_big": _rank_too_big,
    "rank_pattern_too_big": _rank_pattern_too_big,
    "other_base": _other_base,
    "unknown_module_name": _unknown_module_name,
    "unknown_module_layer": _unknown_module_layer,
    "missing_config": _missing_config,
    "missing_weights": _missing_weights,
    "nan": _not_finite,
    "inf": _not_finite,
    "neg_inf": _not_finite,
    "pickle_only": _pickle_only,
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_factories(llama, work, case):
    factory, phrase = BAD_ADAPTERS[case]
    made = Made(case, factory(llama, work / f"bad-{case}"), llama)
    check = _unreadable if case.startswith(("truncated", "corrupt")) else SELF_CHECKS.get(case)
    if check is None:
        pytest.fail(f"no self-check for {case}")
    check(made)
    assert phrase == phrase.lower()


def test_pickle_decoys(llama, work):
    d, decoys, marker = make_adapter_with_pickle_decoys(llama, work / "decoys", target_modules=["q_proj"])
    assert _readable(d / ADAPTER_WEIGHTS)
    assert {p.name for p in decoys} == {"adapter_model.bin", "adapter_model.pt"}
    # The .bin is not loadable at all; the .pt would run code if unpickled without weights_only.
    with pytest.raises(pickle.UnpicklingError):
        torch.load(decoys[0], weights_only=False)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(decoys[1], weights_only=True)
    assert not marker.exists()


def test_corrupt_header_length_really_is_huge(llama, work):
    d = make_corrupt_header_adapter(llama, work / "huge", how="huge_length")
    (n,) = struct.unpack("<Q", (d / ADAPTER_WEIGHTS).read_bytes()[:8])
    assert n > (d / ADAPTER_WEIGHTS).stat().st_size
