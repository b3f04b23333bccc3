"""The per-rank LoRA pool (docs/design.md §4): host store of loaded adapters, device slots, LRU.

Every decision depends only on the order of operations every rank receives (a logical clock,
slot indices, names as given), never on wall time or hash order, so all ranks of an engine make
the same slot and eviction decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.engine.adapters.reads import AdapterShard
from node_agent.engine.model.lora_layers import LoraSlots
from node_agent.engine.parallel.sharding import ModuleKey


class PoolError(RuntimeError):
    """A pool request cannot be met (capacity, unknown adapter); the pool is unchanged."""


@dataclass
class PooledAdapter:
    """One loaded adapter: this rank's shard, whether it is pinned, when a batch last used it."""

    shard: AdapterShard
    pinned: bool
    last_used: int = 0


class LoraPool:
    """Host store (up to `max_loaded`) and `num_slots` device slots in every LoRA layer."""

    def __init__(self, modules: dict[ModuleKey, LoraSlots], num_slots: int, max_loaded: int) -> None:
        self.modules = modules
        self.max_loaded = max_loaded
        self.adapters: dict[str, PooledAdapter] = {}
        self.slots: list[str | None] = [None] * num_slots
        self.clock = 0

    def add(self, name: str, shard: AdapterShard, pinned: bool) -> None:
        """Store an adapter; a pinned one also takes a slot at once and keeps it."""
        if name in self.adapters:
            raise PoolError(f"adapter {name!r} is already loaded")
        if len(self.adapters) >= self.max_loaded:
            raise PoolError(f"max_loaded_loras ({self.max_loaded}) reached; unload an adapter first")
        if pinned and self._free_or_evictable(set()) is None:
            raise PoolError(f"cannot pin {name!r}: all {len(self.slots)} LoRA slots hold pinned adapters")
        self.adapters[name] = PooledAdapter(shard, pinned)
        if pinned:
            self._make_resident(name, set())

    def remove(self, name: str) -> None:
        """Forget an adapter and zero its slot."""
        if name not in self.adapters:
            raise PoolError(f"adapter {name!r} is not loaded")
        if name in self.slots:
            self._clear(self.slots.index(name))
        del self.adapters[name]

    def prepare(self, names: list[str]) -> dict[str, int]:
        """Make every adapter of a batch resident; return each one's slot.

        Refused (pool unchanged) if an adapter is unknown or the batch needs more slots than
        are free or evictable (unpinned and not used by this batch).
        """
        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if n not in self.adapters]
        if unknown:
            raise PoolError(f"adapter {unknown[0]!r} is not loaded")
        missing = [n for n in wanted if n not in self.slots]
        available = sum(1 for i in range(len(self.slots)) if self._usable(i, set(wanted)))
        if len(missing) > available:
            pinned = sum(1 for held in self.slots if held and self.adapters[held].pinned)
            raise PoolError(
                f"no free LoRA slot: the batch needs {len(wanted)} adapters, {len(self.slots)} slots (max_loras_per_batch), {pinned} pinned"
            )
        self.clock += 1
        for name in missing:
            self._make_resident(name, set(wanted))
        for name in wanted:
            self.adapters[name].last_used = self.clock
        return {name: self.slots.index(name) for name in wanted}

    def resident(self) -> dict[int, str]:
        """Slot -> name of the adapter it holds, for occupied slots."""
        return {i: name for i, name in enumerate(self.slots) if name is not None}

    def _usable(self, slot: int, in_batch: set[str]) -> bool:
        held = self.slots[slot]
        return held is None or (not self.adapters[held].pinned and held not in in_batch)

    def _free_or_evictable(self, in_batch: set[str]) -> int | None:
        """An empty slot (lowest first), else the least recently used evictable one."""
        held_by: dict[int, str] = {}
        for i, held in enumerate(self.slots):
            if held is None:
                return i
            held_by[i] = held
        candidates = [i for i in held_by if self._usable(i, in_batch)]
        if not candidates:
            return None
        return min(candidates, key=lambda i: (self.adapters[held_by[i]].last_used, i))

    def _make_resident(self, name: str, in_batch: set[str]) -> None:
        slot = self._free_or_evictable(in_batch)
        if slot is None:
            raise PoolError(f"no free LoRA slot for {name!r}")
        if self.slots[slot] is not None:
            self._clear(slot)
        shard = self.adapters[name].shard
        for key, module in self.modules.items():
            weights = shard.weights.get(key)
            if weights is None:
                module.clear_slot(slot)
            else:
                module.set_slot(slot, weights)
        self.slots[slot] = name
        self.adapters[name].last_used = self.clock

    def _clear(self, slot: int) -> None:
        for module in self.modules.values():
            module.clear_slot(slot)
        self.slots[slot] = None
