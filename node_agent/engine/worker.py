"""The rank process: holds one shard of the model and the LoRA pool, obeys the driver's commands.

A rank answers every command with a `RankReply`; it never raises to the driver. Commands reach
all ranks in the same order, which is what keeps the pools' decisions identical.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from node_agent.engine.checkpoint import Checkpoint
from node_agent.engine.distributed import init_process_groups
from node_agent.engine.kernels import LoraBatch
from node_agent.engine.lora_layers import LoraCapacity
from node_agent.engine.model import CausalLM, ForwardContext
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.peft_adapter import AdapterLoadError, read_adapter_shard, read_adapter_spec
from node_agent.engine.pool import LoraPool, PoolError
from node_agent.engine.topology import Topology, assign_sequences

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """What a rank needs to start; plain data so it pickles into a spawned process."""

    model_dir: Path
    topology: Topology
    max_lora_rank: int
    max_loras_per_batch: int
    max_loaded_loras: int
    device: str
    dtype: str
    master_port: int
    timeout_s: float
    fault_fail_load_on_rank: int | None = None  # test-only: this rank refuses every load


@dataclass(frozen=True)
class RankReply:
    """One rank's answer to one command."""

    rank: int
    attn_dp_rank: int
    attn_tp_rank: int
    ok: bool
    error: str = ""
    payload: Any = field(default=None, compare=False)


class RankWorker:
    """The state of one rank and one method per command."""

    def __init__(self, config: WorkerConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.coords = config.topology.coords(rank)
        self.device = torch.device(config.device if config.device == "cpu" else f"cuda:{rank}")
        self.dtype = getattr(torch, config.dtype)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.groups = init_process_groups(config.topology, rank, "127.0.0.1", config.master_port, backend, config.timeout_s)
        self.cfg = ModelConfig.from_dir(config.model_dir)
        capacity = LoraCapacity(config.max_lora_rank, config.max_loras_per_batch, config.topology.fully_sharded_loras)
        self.model = CausalLM(self.cfg, config.topology, rank, self.groups, capacity, self.dtype, self.device)
        self.model.load_base(Checkpoint(config.model_dir))
        self.modules = self.model.lora_modules()
        self.layouts = {key: module.lora_slices() for key, module in self.modules.items()}
        self.pool = LoraPool(self.modules, config.max_loras_per_batch, config.max_loaded_loras)

    def describe(self) -> dict:
        """This rank's coordinates and every LoRA module's per-slot A/B buffer shapes."""
        return {
            "modules": {_module_name(key): _shapes(module.slot_shapes()) for key, module in self.modules.items()},
            "resident": self.pool.resident(),
            "loaded": list(self.pool.adapters),
        }

    def load(self, name: str, path: str, pinned: bool) -> dict:
        if self.config.fault_fail_load_on_rank == self.rank:
            raise AdapterLoadError(f"injected load failure on rank {self.rank}")
        baseline = _reset_peak_rss()
        spec = read_adapter_spec(Path(path), self.cfg, self.config.max_lora_rank)
        shard = read_adapter_shard(spec, self.layouts, self.dtype)
        self.pool.add(name, shard, pinned)
        return {"shard_bytes": shard.nbytes, "peak_rss_growth_bytes": _proc_status_bytes("VmHWM") - baseline}

    def unload(self, name: str) -> None:
        self.pool.remove(name)

    def forward(self, sequences: list[tuple[list[int], str | None]]) -> dict[int, Any]:
        """Run one batch; the attention-TP leader of each group returns its sequences' logits."""
        slots = self.pool.prepare([adapter for _, adapter in sequences if adapter])
        dp_size = self.config.topology.dp_size
        group_of = assign_sequences([len(tokens) for tokens, _ in sequences], dp_size)
        members = [[i for i, g in enumerate(group_of) if g == group] for group in range(dp_size)]
        counts = [sum(len(sequences[i][0]) for i in group) for group in members]
        all_slots = [
            slots[sequences[i][1]] if sequences[i][1] else -1
            for group in members for i in group for _ in sequences[i][0]
        ]
        mine = members[self.coords.attn_dp_rank]
        tokens = [t for i in mine for t in sequences[i][0]]
        offset = sum(counts[: self.coords.attn_dp_rank])
        seq_lens = [len(sequences[i][0]) for i in mine]
        cos, sin = self.model.rope_tables(seq_lens)
        to_device = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        ctx = ForwardContext(
            seq_lens=seq_lens,
            group_token_counts=counts,
            attn_dp_rank=self.coords.attn_dp_rank,
            attn_tp_rank=self.coords.attn_tp_rank,
            attn_lora=LoraBatch.from_token_slots(to_device(all_slots[offset : offset + len(tokens)])),
            mlp_lora=LoraBatch.from_token_slots(to_device(all_slots)),
            cos=cos,
            sin=sin,
        )
        logits = self.model(to_device(tokens), ctx)
        if self.coords.attn_tp_rank != 0:
            return {}
        out, start = {}, 0
        for i, length in zip(mine, seq_lens):
            out[i] = logits[start : start + length].cpu().numpy()
            start += length
        return out


def _shapes(slot_shapes: list[tuple[list[int], list[int]]]) -> dict[str, list[list[int]]]:
    """Per-slice (A, B) slot shapes as {"a": [...], "b": [...]}."""
    return {"a": [a for a, _ in slot_shapes], "b": [b for _, b in slot_shapes]}


def _module_name(key: tuple) -> str:
    """(layer, kind[, expert]) → "layers.L.kind" or "layers.L.experts.E.proj"."""
    if len(key) == 3:
        layer, kind, expert = key
        return f"layers.{layer}.experts.{expert}.{kind.split('.', 1)[1]}"
    return f"layers.{key[0]}.{key[1]}"


def _proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), in bytes; 0 elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark so a load's own peak can be measured; returns RSS now."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _proc_status_bytes("VmRSS")


def rank_main(config: WorkerConfig, rank: int, conn: Connection) -> None:
    """Entry point of a spawned rank process: start, report readiness, then serve commands."""
    logging.basicConfig(level=os.environ.get("LORAFLEET_LOG_LEVEL", "WARNING"), format=f"rank{rank} %(levelname)s %(name)s: %(message)s")
    if config.device == "cpu":
        # Ranks share the machine's cores; oversubscription makes every collective wait.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.topology.tp_size))
    coords = config.topology.coords(rank)

    def reply(ok: bool, error: str = "", payload: Any = None) -> RankReply:
        return RankReply(rank, coords.attn_dp_rank, coords.attn_tp_rank, ok, error, payload)

    try:
        worker = RankWorker(config, rank)
    except Exception as error:  # any startup failure is reported, then the rank exits
        log.debug("startup failed: %s", traceback.format_exc())
        conn.send(reply(False, f"rank {rank} failed to start: {error}"))
        return
    conn.send(reply(True))
    handlers = {"describe": worker.describe, "load": worker.load, "unload": worker.unload, "forward": worker.forward}
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return  # the driver is gone
        if command == "shutdown":
            conn.send(reply(True))
            return
        try:
            conn.send(reply(True, payload=handlers[command](**kwargs)))
        except (AdapterLoadError, PoolError) as error:
            conn.send(reply(False, str(error)))
        except Exception as error:  # report, keep serving: one bad request must not kill the rank
            log.error("command %s failed: %s", command, traceback.format_exc())
            conn.send(reply(False, f"{type(error).__name__}: {error}"))
