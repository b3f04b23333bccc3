"""Every rank's LoRA buffer shapes as the sharding rule gives them, without starting a rank: what
`Describe` reports for a dense model (a backend that simulates the engine's ranks answers with
them)."""

from __future__ import annotations

from pathlib import Path

from node_agent.backend import ModuleShape, SliceShape
from node_agent.engine.driver.errors import EngineError
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import lora_layout, model_kinds, module_layout
from node_agent.engine.parallel.topology import Topology


def dense_module_shapes(model_dir: Path, topology: Topology, max_lora_rank: int, rank: int) -> tuple[ModuleShape, ...]:
    """Rank `rank`'s per-slot LoRA A/B shapes of every module of the dense model in `model_dir`
    ("layers.L.kind"); EngineError for an MoE model (its experts' names need the model)."""
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.moe:
        raise EngineError(f"{model_dir}: module shapes without a rank are known for dense models only")
    modules = []
    for layer in range(cfg.num_layers):
        for kind in model_kinds(cfg):
            slices = lora_layout(module_layout(cfg, topology, rank, kind), max_lora_rank, topology.fully_sharded_loras)
            shapes = tuple(SliceShape((s.a_rank.width, s.a_in.width), (s.b_out.width, s.b_rank.width)) for s in slices)
            modules.append(ModuleShape(f"layers.{layer}.{kind}", rank, shapes))
    return tuple(modules)
