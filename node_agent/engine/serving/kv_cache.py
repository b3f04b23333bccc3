"""The paged KV cache (docs/serving.md): a block allocator and the tensors it hands out.

Two halves, deliberately apart:

* `BlockAllocator` is pure Python and owns every decision: which blocks a sequence holds, which
  cached prefix it reuses, what is evicted. The driver's scheduler runs one per DP-attention
  group, so every rank of that group receives the same block tables and slot mappings, never
  computes them itself.
* `PagedKVCache` is one rank's storage: per layer, K and V for the rank's own KV heads (for MLA
  models one latent per token instead), written at the slots the allocator chose and read by
  `kernels.paged_attention`.

Slot `s` is token `s % block_size` of block `s // block_size`.

Prefix caching keys a full block by a SHA-256 chain over (adapter identity, the block's token
ids, the key of the block before it), so a cached block is reused only for the same adapter and
the same tokens at the same position, and never between an adapter and the base model. Blocks
are registered only once their KV is written (`mark_written`), so nothing can read a block
whose content a failed step never stored.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import attention_heads
from node_agent.engine.parallel.topology import Topology

# Identity of the weights a sequence runs with, for prefix caching: None is the base model. It
# must change whenever an adapter name is loaded again with other weights (name plus the
# registry's load generation, say), or a replaced adapter would reuse its predecessor's KV.
AdapterKey = str | None


class KVCacheError(ValueError):
    """A KV cache request that cannot be honoured (budget too small, unknown sequence, ...)."""


def block_key(parent: bytes | None, adapter: AdapterKey, tokens: Sequence[int]) -> bytes:
    """Content key of one full block: everything its KV depends on, unambiguously encoded."""
    digest = hashlib.sha256()
    digest.update(b"R" if parent is None else b"P" + parent)
    if adapter is None:
        digest.update(b"B")
    else:
        name = adapter.encode()
        digest.update(b"A" + struct.pack("<Q", len(name)) + name)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


@dataclass
class _Sequence:
    """The allocator's view of one sequence."""

    adapter: AdapterKey
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # every token given a slot, in order
    keys: list[bytes] = field(default_factory=list)  # content keys of its leading full, written blocks


class BlockAllocator:
    """Blocks of one DP-attention group: free list, block tables, reference counts, prefix cache.

    Deterministic: the same calls in the same order give the same blocks (FIFO free list, LRU
    eviction by release order, no iteration over hashed sets).
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise KVCacheError(f"need at least one block of at least one token, got {num_blocks} × {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # never-cached (or evicted) blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._refs = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._seqs: dict[int, _Sequence] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is registered in the prefix cache (referenced or not)."""
        return len(self._cached)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """The sequence's blocks, in token order."""
        return tuple(self._seq(seq_id).blocks)

    def num_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence that have a slot (cached prefix included)."""
        return len(self._seq(seq_id).tokens)

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """New blocks `append` would take for `num_new_tokens` more tokens."""
        seq = self._seq(seq_id)
        return max(0, math.ceil((len(seq.tokens) + num_new_tokens) / self.block_size) - len(seq.blocks))

    def add(self, seq_id: int, adapter: AdapterKey, prompt: Sequence[int], reuse: bool = True) -> int:
        """Register a sequence and claim its longest cached prefix; returns the cached token count.

        The prefix covers whole blocks only and leaves at least the prompt's last token to be
        computed (its logits are needed). The caller then `append`s `prompt[cached:]` in chunks.
        With `reuse` false nothing is claimed (a Forward needs every position's logits); its
        blocks still enter the cache once written.
        """
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already has blocks")
        seq = _Sequence(adapter)
        self._seqs[seq_id] = seq
        if not self.prefix_caching or not reuse:
            return 0
        parent: bytes | None = None
        for index in range((len(prompt) - 1) // self.block_size):
            tokens = prompt[index * self.block_size : (index + 1) * self.block_size]
            key = block_key(parent, adapter, tokens)
            block = self._cached.get(key)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            seq.blocks.append(block)
            seq.tokens.extend(tokens)
            seq.keys.append(key)
            parent = key
        return len(seq.tokens)

    def append(self, seq_id: int, token_ids: Sequence[int]) -> list[int] | None:
        """Give `token_ids` the next slots of the sequence; None (and no change) if blocks run out.

        Returns one slot per token, for `PagedKVCache.write`.
        """
        seq = self._seq(seq_id)
        needed = self.blocks_needed(seq_id, len(token_ids))
        if needed > self.num_free_blocks:
            return None
        for _ in range(needed):
            seq.blocks.append(self._take_block())
        first = len(seq.tokens)
        seq.tokens.extend(token_ids)
        return [seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size for pos in range(first, len(seq.tokens))]

    def mark_written(self, seq_id: int) -> None:
        """Every slot handed out so far now holds its KV: register the sequence's new full blocks.

        A block whose content is already cached elsewhere (two sequences computed the same
        prefix at once) stays private and returns to the free list when released.
        """
        seq = self._seq(seq_id)
        if not self.prefix_caching:
            return
        for index in range(len(seq.keys), len(seq.tokens) // self.block_size):
            parent = seq.keys[-1] if seq.keys else None
            key = block_key(parent, seq.adapter, seq.tokens[index * self.block_size : (index + 1) * self.block_size])
            seq.keys.append(key)
            block = seq.blocks[index]
            if key not in self._cached:
                self._cached[key] = block
                self._key_of[block] = key

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (finish, cancel, preemption); cached ones become evictable.

        Released tail first, so that eviction takes a prefix's last blocks before its first.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KVCacheError(f"sequence {seq_id} has no blocks")
        for block in reversed(seq.blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if self._key_of[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def _take_block(self) -> int:
        """A free block, else the least recently released cached one (its content forgotten)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self._key_of[block]
            assert key is not None  # only cached blocks are ever evictable
            del self._cached[key]
            self._key_of[block] = None
        self._refs[block] = 1
        return block

    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KVCacheError(f"sequence {seq_id} has no blocks")
        return seq


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape of one rank's cache. `num_kv_heads` is this rank's (the sharding module's answer).

    `latent`: MLA's cache (DeepSeek-V2/V3), one tensor per layer holding each token's latent
    (`head_dim` = kv_lora_rank + qk_rope_head_dim, `num_kv_heads` 1) instead of K and V per head.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    latent: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise KVCacheError(f"KVCacheLayout.{name} must be at least 1, got {getattr(self, name)}")

    @property
    def tensors_per_layer(self) -> int:
        """K and V, or MLA's one latent."""
        return 1 if self.latent else 2

    @property
    def bytes_per_token(self) -> int:
        """One token's cache over every layer on this rank."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.tensors_per_layer * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        """K and V (or the latent) of one block over every layer."""
        return self.block_size * self.bytes_per_token

    def blocks_for_budget(self, budget_bytes: int) -> int:
        """How many blocks `budget_bytes` holds; an error if not even one."""
        blocks = budget_bytes // self.bytes_per_block
        if blocks < 1:
            what = "the latent" if self.latent else "K and V"
            raise KVCacheError(
                f"KV cache budget of {budget_bytes} bytes cannot hold one block of {self.bytes_per_block} bytes "
                f"({self.block_size} tokens × {self.num_layers} layers × {self.num_kv_heads} KV heads × "
                f"{self.head_dim} head dim × {what} in {self.dtype})"
            )
        return blocks


def kv_cache_layout(cfg: ModelConfig, topology: Topology, rank: int, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
    """The cache one rank holds: its own KV heads (replicated ones included), as the sharding rule
    gives them; for MLA the latent, once per token whatever the rank's heads."""
    if cfg.mla is not None:
        return KVCacheLayout(cfg.num_layers, 1, cfg.mla.latent_dim, block_size, dtype, latent=True)
    return KVCacheLayout(cfg.num_layers, attention_heads(cfg, topology, rank).kv.width, cfg.head_dim, block_size, dtype)


def budget_from_device_memory(free_bytes: int, total_bytes: int, utilization: float) -> int:
    """The KV budget of one rank under `--gpu-memory-utilization` (vLLM's meaning): the engine
    may use `utilization` of the device's total memory, and what is already in use when the
    cache is sized (the base weights, the LoRA slots, other processes) comes off it. Called
    after the model is loaded; activations are not profiled, so `utilization` below 1 is what
    leaves them room. Raises KVCacheError when nothing is left."""
    if not 0 < utilization <= 1:
        raise KVCacheError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if not 0 <= free_bytes <= total_bytes or total_bytes <= 0:
        raise KVCacheError(f"device memory must have 0 <= free <= total and total > 0, got free {free_bytes}, total {total_bytes}")
    in_use = total_bytes - free_bytes
    budget = int(utilization * total_bytes) - in_use
    if budget <= 0:
        raise KVCacheError(
            f"--gpu-memory-utilization {utilization} allows {int(utilization * total_bytes)} of the device's "
            f"{total_bytes} bytes, but {in_use} are already in use (model, LoRA slots, other processes): "
            "nothing is left for the KV cache"
        )
    return budget


class PagedKVCache:
    """One rank's K and V blocks: per layer `[num_blocks, block_size, num_kv_heads, head_dim]`
    (an MLA cache: one latent block tensor per layer, `[num_blocks, block_size, 1, latent_dim]`).

    Token-major inside a block, heads then head_dim innermost: a write is one `index_copy_` per
    tensor on the flattened slot dim, and the paged kernels read each token's head as one
    contiguous `head_dim` row. One allocation holds every layer; zeroed, so slots never written
    are finite and masked attention weights (exact zeros) cannot meet a NaN.
    """

    def __init__(self, layout: KVCacheLayout, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise KVCacheError(f"need at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.num_layers, layout.tensors_per_layer, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self._storage = torch.zeros(shape, dtype=layout.dtype, device=device)

    @classmethod
    def from_budget(cls, layout: KVCacheLayout, budget_bytes: int, device: torch.device) -> PagedKVCache:
        """As many blocks as `budget_bytes` holds (every rank of an engine gets the same count
        from the same budget, since ranks of one engine share one layout)."""
        return cls(layout, layout.blocks_for_budget(budget_bytes), device)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return self._storage.numel() * self._storage.element_size()

    def key(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K blocks, `[num_blocks, block_size, num_kv_heads, head_dim]` (a view)."""
        return self._storage[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s V blocks (a view)."""
        if self.layout.latent:
            raise KVCacheError("an MLA cache holds one latent per token and no V; read latent()")
        return self._storage[layer, 1]

    def latent(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s MLA latents, `[num_blocks, block_size, 1, latent_dim]` (a view)."""
        if not self.layout.latent:
            raise KVCacheError("this cache holds K and V per head, no latent")
        return self._storage[layer, 0]

    def write_latent(self, layer: int, slot_mapping: torch.Tensor, latent: torch.Tensor) -> None:
        """Store new tokens' latents (`[T, latent_dim]`) at `slot_mapping` (`[T]`)."""
        dim = self.layout.head_dim
        if latent.dim() != 2 or latent.shape[1] != dim or slot_mapping.shape != latent.shape[:1]:
            raise KVCacheError(
                f"write_latent needs latent [T, {dim}] and slot_mapping [T]; got latent "
                f"{tuple(latent.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
            )
        self.latent(layer).view(-1, dim).index_copy_(0, slot_mapping.to(torch.int64), latent.to(self.layout.dtype))

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K and V (`[T, num_kv_heads, head_dim]`) at `slot_mapping` (`[T]`)."""
        if self.layout.latent:
            raise KVCacheError("an MLA cache holds latents; use write_latent")
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (heads, dim) or slot_mapping.shape != k.shape[:1]:
            raise KVCacheError(
                f"write needs k, v [T, {heads}, {dim}] and slot_mapping [T]; got k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
            )
        # Conversions only where needed: `to` dispatches an op even when it returns its input,
        # and this runs in every layer of every step.
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
        dtype = self.layout.dtype
        self.key(layer).view(-1, heads, dim).index_copy_(0, slots, k if k.dtype == dtype else k.to(dtype))
        self.value(layer).view(-1, heads, dim).index_copy_(0, slots, v if v.dtype == dtype else v.to(dtype))
