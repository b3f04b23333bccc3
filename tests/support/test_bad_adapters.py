"""Self-checks of tests/support/bad_adapters.py: each factory produces the defect it names."""

from __future__ import annotations

import pickle
import struct

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


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_factories(llama, work, case):
    factory, phrase = BAD_ADAPTERS[case]
    d = factory(llama, work / f"bad-{case}")
    files = {p.name for p in d.iterdir()}
    weights = d / ADAPTER_WEIGHTS
    cfg = adapter_config(d) if (d / ADAPTER_CONFIG).exists() else None
    if case == "dora":
        assert cfg["use_dora"] is True
        assert any(k.endswith("lora_magnitude_vector") for k in adapter_tensors(d))
    elif case == "modules_to_save":
        assert cfg["modules_to_save"] == ["lm_head"]
        assert "base_model.model.lm_head.weight" in adapter_tensors(d)
    elif case in ("bias_all", "bias_lora_only"):
        assert cfg["bias"] == case.removeprefix("bias_")
    elif case == "lora_bias":
        assert cfg["lora_bias"] is True
        assert any(k.endswith("lora_B.bias") for k in adapter_tensors(d))
    elif case == "rank_too_big":
        assert cfg["r"] == 32 and adapter_tensors(d)[lora_key(0, "q_proj", "A")].shape[0] == 32
    elif case == "rank_pattern_too_big":
        assert cfg["r"] == 4 and cfg["rank_pattern"] == {"v_proj": 32}
        assert adapter_tensors(d)[lora_key(0, "v_proj", "A")].shape[0] == 32
    elif case == "other_base":
        assert cfg["base_model_name_or_path"] == str(llama)
        assert adapter_tensors(d)[lora_key(0, "q_proj", "A")].shape == (4, 96)
    elif case == "unknown_module_name":
        assert any(".c_attn." in k for k in adapter_tensors(d)) and "c_attn" in cfg["target_modules"]
    elif case == "unknown_module_layer":
        assert any(".layers.7." in k for k in adapter_tensors(d))
    elif case == "missing_config":
        assert ADAPTER_CONFIG not in files and weights.is_file()
    elif case == "missing_weights":
        assert ADAPTER_WEIGHTS not in files and cfg is not None
    elif case.startswith(("truncated", "corrupt")):
        assert weights.is_file() and not _readable(weights)
    elif case in ("nan", "inf", "neg_inf"):
        bad = [k for k, t in adapter_tensors(d).items() if not torch.isfinite(t).all()]
        assert len(bad) == 1, bad
    elif case == "pickle_only":
        assert ADAPTER_WEIGHTS not in files and "adapter_model.bin" in files
        assert set(torch.load(d / "adapter_model.bin", weights_only=True)) >= {lora_key(0, "q_proj", "A")}
    else:
        pytest.fail(f"no self-check for {case}")
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
