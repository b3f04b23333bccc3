"""The engine puts LoRA on exactly the modules PEFT would (`AdapterConfig.targets`), checked against
PEFT's own `check_target_module_exists` for every config field that selects modules:
`target_modules` as a list (exact names, dotted suffixes) or a pattern, `exclude_modules` (list
or pattern), `layers_to_transform` (an index, a list, empty) with and without `layers_pattern`,
and `target_parameters` alone; over module names of dense and MoE layers, one- and two-digit
layer indices. A tensor of a module the config does not select is refused (test_refusals).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists

from node_agent.engine.adapters.config import read_adapter_config
from node_agent.engine.adapters.errors import CONFIG_FILE, AdapterLoadError

MODULE_NAMES = [
    f"model.layers.{layer}.{module}"
    for layer in (0, 1, 3, 10)
    for module in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.down_proj",
        "mlp.experts.0.gate_proj",
        "mlp.experts.3.down_proj",
        "mlp.shared_experts.up_proj",
    )
]

SELECTING_CONFIGS: dict[str, dict[str, Any]] = {
    "list": {"target_modules": ["q_proj", "v_proj"]},
    "dotted_suffixes": {"target_modules": ["self_attn.q_proj", "mlp.down_proj", "experts.3.down_proj"]},
    "exact_name": {"target_modules": ["model.layers.0.self_attn.q_proj", "k_proj"]},
    "pattern": {"target_modules": r".*\.(q|v)_proj"},
    "exclude_list": {"target_modules": ["q_proj", "v_proj", "down_proj"], "exclude_modules": ["v_proj", "layers.1.mlp.down_proj"]},
    "exclude_pattern": {"target_modules": r".*_proj", "exclude_modules": r".*\.experts\..*"},
    "layer_index": {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": 1},
    "layer_list": {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [0, 10]},
    "layer_list_empty": {"target_modules": ["q_proj"], "layers_to_transform": []},
    "layers_pattern": {"target_modules": ["q_proj", "gate_proj"], "layers_to_transform": [3], "layers_pattern": "layers"},
    "layers_patterns": {
        "target_modules": ["gate_proj", "down_proj"],
        "layers_to_transform": [0, 3],
        "layers_pattern": ["blocks", "experts"],
    },
    "exact_name_beside_layers": {"target_modules": ["model.layers.1.self_attn.k_proj", "q_proj"], "layers_to_transform": [0]},
    "parameters_only": {"target_modules": None, "target_parameters": ["mlp.experts.gate_up_proj"]},
}


def engine_config(tmp_path: Path, fields: dict[str, Any]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **fields}))
    return read_adapter_config(tmp_path)


@pytest.mark.parametrize("case", sorted(SELECTING_CONFIGS))
def test_the_engine_selects_the_modules_peft_selects(tmp_path, case):
    fields = SELECTING_CONFIGS[case]
    ours = engine_config(tmp_path, fields)
    peft = LoraConfig(r=4, lora_alpha=8, **fields)
    want = {name for name in MODULE_NAMES if check_target_module_exists(peft, name)}
    got = {name for name in MODULE_NAMES if ours.targets(name)}
    assert got == want
    if case != "parameters_only":
        assert want, "each case selects some module"
    assert set(MODULE_NAMES) - want, "and leaves some out"


def test_all_linear_selects_every_module(tmp_path):
    # PEFT expands "all-linear" against the model before matching; the engine's modules are all linear.
    ours = engine_config(tmp_path, {"target_modules": "all-linear"})
    assert all(ours.targets(name) for name in MODULE_NAMES)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"target_modules": r".*_proj", "layers_to_transform": [0]}, "layers_to_transform cannot be used with a string target_modules"),
        ({"target_modules": r".*_proj", "layers_pattern": "layers"}, "layers_pattern cannot be used with a string target_modules"),
        ({"target_modules": ["q_proj"], "layers_pattern": "layers"}, "layers_pattern needs layers_to_transform"),
        ({"target_modules": ["q_proj"], "layers_to_transform": "0"}, "layers_to_transform:"),
        ({"target_modules": ["q_proj"], "layers_to_transform": [-1]}, "layers_to_transform[0]:"),
        ({"target_modules": ["q_proj"], "exclude_modules": 5}, "exclude_modules:"),
        ({"target_modules": ["q_proj"], "exclude_modules": r"(a)\1"}, "exclude_modules"),
        ({"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "(?<=x)layers"}, "layers_pattern"),
    ],
)
def test_what_peft_refuses_or_re2_cannot_run_is_refused_naming_the_field(tmp_path, fields, message):
    with pytest.raises(AdapterLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine_config(tmp_path, fields)
