"""The rank process: holds one shard of the model and the LoRA pool, obeys the driver's commands.

A rank answers every command with that command's reply (`node_agent.engine.driver.protocol`); it never
raises to the driver. Commands reach all ranks in the same order, which is what keeps the pools'
decisions identical.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import traceback
from multiprocessing.connection import Connection

import torch

from node_agent.backend import ControlReply, ModuleShape, RankReply, SliceShape
from node_agent.engine.adapters.errors import AdapterLoadError
from node_agent.engine.adapters.files import ContentChanged, HeldFiles
from node_agent.engine.adapters.pool import LoraPool, PoolError
from node_agent.engine.adapters.reads import read_planned_shard, warm_up_shard_reads
from node_agent.engine.driver.config import RankConfig
from node_agent.engine.driver.faults import FaultPlan, InjectedFault
from node_agent.engine.driver.protocol import Command, Describe, DescribeReply, Load, ReadyReply, Shutdown, Step, StepReply, Unload
from node_agent.engine.kernels import LoraBatch
from node_agent.engine.model.checkpoint import Checkpoint
from node_agent.engine.model.context import AttentionBatch, ForwardContext, RankSetup, block_table_tensor
from node_agent.engine.model.decoder import CausalLM
from node_agent.engine.model.lora_layers import LoraCapacity
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.distributed import init_process_groups
from node_agent.engine.serving.kv_cache import PagedKVCache, budget_from_device_memory, kv_cache_layout
from node_agent.engine.serving.sampler import sample
from node_agent.engine.serving.scheduling import ScheduledSequence

log = logging.getLogger(__name__)


class RankWorker:
    """The state of one rank and one method per command, each returning that command's reply."""

    def __init__(self, rank_config: RankConfig, rank: int, faults: FaultPlan | None = None) -> None:
        config = self.config = rank_config.engine
        self.rank = rank
        self.faults = faults
        self.coords = config.topology.coords(rank)
        self.device = torch.device(config.device if config.device == "cpu" else f"cuda:{rank}")
        self.dtype = getattr(torch, config.torch_dtype_name)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.groups = init_process_groups(config.topology, rank, rank_config.store_port, backend, config.startup_timeout_s)
        self.cfg = ModelConfig.from_dir(config.model_dir)
        capacity = LoraCapacity(config.max_lora_rank, config.max_loras_per_batch, config.topology.fully_sharded_loras)
        self.model = CausalLM(RankSetup(self.cfg, config.topology, rank, self.groups, capacity, self.dtype, self.device))
        self.model.load_base(Checkpoint(config.model_dir))
        self.modules = self.model.lora_modules()
        self.layouts = {key: module.lora_slices() for key, module in self.modules.items()}
        self.module_keys = tuple(self.layouts)  # a load's plan names modules by position here
        self.pool = LoraPool(self.modules, config.max_loras_per_batch, config.max_loaded_loras)
        # The shard reader's kernels map their code now, not during the first load: a load's peak
        # memory growth is then its shard alone (Load's peak_rss_growth_bytes; docs/engine.md).
        warm_up_shard_reads(self.dtype)
        # The rank's own KV heads, as the sharding rule gives them (replicated heads included),
        # or MLA's latent once per token.
        self.kv_layout = kv_cache_layout(self.cfg, config.topology, rank, config.block_size, self.dtype)
        self.kv_cache_bytes = config.kv_cache_bytes
        if config.gpu_memory_utilization is not None:
            # Sized after the weights and the LoRA slots are allocated, so they count as in use.
            free, total = torch.cuda.mem_get_info(self.device)
            self.kv_cache_bytes = budget_from_device_memory(free, total, config.gpu_memory_utilization)
        self.kv = PagedKVCache.from_budget(self.kv_layout, self.kv_cache_bytes, self.device)
        # Every slot decision this rank made (one per Step), hashed in order: all ranks of an
        # engine must make the same ones, and Describe lets the driver compare them.
        self.slot_digest = hashlib.sha256()
        self.slot_decisions = 0

    def run(self, command: Command) -> RankReply:
        """Carry out one command; a refusal or an unexpected error becomes a failed reply."""
        try:
            return self._dispatch(command)
        except ContentChanged as error:
            return ControlReply(
                self.rank, self.coords.attn_dp_rank, self.coords.attn_tp_rank, False, str(error), holds=self.holds(), read_other_bytes=True
            )
        except (AdapterLoadError, PoolError, InjectedFault) as error:
            return self.failed(command, str(error))
        except Exception as error:  # report, keep serving: one bad request must not kill the rank
            log.error("command %s failed: %s", type(command).__name__, traceback.format_exc())
            return self.failed(command, f"{type(error).__name__}: {error}")

    def _dispatch(self, command: Command) -> RankReply:
        match command:
            case Describe():
                return self.describe()
            case Load():
                return self.load(command)
            case Unload():
                return self.unload(command)
            case Step():
                return self.step(command)
            case Shutdown():
                return self.reply()

    def reply(self, ok: bool = True, error: str = "") -> RankReply:
        return RankReply(self.rank, self.coords.attn_dp_rank, self.coords.attn_tp_rank, ok, error)

    def ready(self) -> ReadyReply:
        """The start-up reply: this rank's LoRA layouts, in the order a load's plan names them."""
        return ReadyReply(self.rank, self.coords.attn_dp_rank, self.coords.attn_tp_rank, True, lora_layouts=tuple(self.layouts.items()))

    def failed(self, command: Command, error: str) -> RankReply:
        """The failed reply of `command`'s kind; a control reply still says what the rank holds."""
        head = (self.rank, self.coords.attn_dp_rank, self.coords.attn_tp_rank, False, error)
        match command:
            case Load() | Unload():
                return ControlReply(*head, holds=self.holds())
            case Describe():
                return DescribeReply(*head, holds=self.holds())
            case Step():
                return StepReply(*head)
            case Shutdown():
                return RankReply(*head)

    def holds(self) -> tuple[str, ...]:
        """The adapters this rank's pool holds, in load order."""
        return tuple(self.pool.adapters)

    def describe(self) -> DescribeReply:
        """This rank's coordinates, every LoRA module's per-slot A/B buffer shapes, its slots."""
        modules = tuple(
            ModuleShape(_module_name(key), self.rank, tuple(SliceShape(tuple(a), tuple(b)) for a, b in module.slot_shapes()))
            for key, module in self.modules.items()
        )
        resident = tuple(sorted(self.pool.resident().items()))
        return DescribeReply(
            self.rank,
            self.coords.attn_dp_rank,
            self.coords.attn_tp_rank,
            True,
            modules=modules,
            resident=resident,
            holds=self.holds(),
            kv_blocks=self.kv.num_blocks,
            kv_block_bytes=self.kv_layout.bytes_per_block,
            kv_cache_bytes=self.kv_cache_bytes,
            slot_decisions=self.slot_decisions,
            slot_digest=self.slot_digest.hexdigest(),
        )

    def load(self, command: Load) -> ControlReply:
        if self.faults is not None:
            self.faults.before_load(self.rank)  # tests only: before any adapter byte is read
        baseline = _reset_peak_rss()
        verified = command.adapter
        # The driver parsed and matched the adapter once and planned this rank's read; the rank
        # carries the plan out, from the very files the driver checked (their identity) and
        # through the descriptor it checked.
        with HeldFiles(verified.path, f"rank {self.rank}") as held:
            held.require(verified)
            shard = read_planned_shard(command.plan, held.weights_fd, self.module_keys, self.dtype)
            held.check_unchanged()
        self.pool.add(command.name, shard, command.pinned)
        return ControlReply(
            self.rank,
            self.coords.attn_dp_rank,
            self.coords.attn_tp_rank,
            True,
            holds=self.holds(),
            shard_bytes=shard.nbytes,
            peak_rss_growth_bytes=_peak_rss_bytes() - baseline,
            digests=verified.digests,
        )

    def unload(self, command: Unload) -> ControlReply:
        self.pool.remove(command.name)
        return ControlReply(self.rank, self.coords.attn_dp_rank, self.coords.attn_tp_rank, True, holds=self.holds())

    def step(self, command: Step) -> StepReply:
        """Run one scheduler step: this group's entries over the rank's KV cache; every rank of
        the group samples the same tokens from the same gathered logits, the leader reports them."""
        groups = command.groups
        slots = self._prepare([entry.adapter for group in groups for entry in group if entry.adapter])
        counts = [sum(len(entry.token_ids) for entry in group) for group in groups]
        all_slots = [slots[entry.adapter] if entry.adapter else -1 for group in groups for entry in group for _ in entry.token_ids]
        mine: tuple[ScheduledSequence, ...] = groups[self.coords.attn_dp_rank]
        tokens = [t for entry in mine for t in entry.token_ids]
        positions = [entry.position + i for entry in mine for i in range(len(entry.token_ids))]
        # The LM head runs on the rows that sample (a chunk's last token) and on every row of a
        # Forward's chunk: `spans` has where each Forward chunk's rows start among its outputs,
        # `drawing` where each sampling row is.
        rows: list[int] = []
        spans: list[tuple[ScheduledSequence, int]] = []
        drawing: list[int] = []
        end = 0
        for entry in mine:
            if entry.logits:
                spans.append((entry, len(rows)))
                rows.extend(range(end, end + len(entry.token_ids)))
            end += len(entry.token_ids)
            if entry.sampling is not None:
                drawing.append(len(rows))
                rows.append(end - 1)
        attention = AttentionBatch(
            kv=self.kv,
            slot_mapping=self._ids([s for entry in mine for s in entry.slots]),
            block_tables=block_table_tensor([list(entry.block_table) for entry in mine], self.device),
            query_lens=[len(entry.token_ids) for entry in mine],
            context_lens=[entry.context_len for entry in mine],
        )
        logits = self.model(self._ids(tokens), self._context(counts, all_slots, positions, attention, rows))
        sampling = [entry for entry in mine if entry.sampling is not None]
        # Forward chunks sample nothing: only the sampling rows go to the sampler.
        sampled = logits[self._ids(drawing)] if spans else logits
        drawn = sample(sampled, [entry.sampling for entry in sampling if entry.sampling is not None]) if sampling else []
        head = (self.rank, self.coords.attn_dp_rank, self.coords.attn_tp_rank, True)
        if self.coords.attn_tp_rank != 0:
            return StepReply(*head)
        return StepReply(
            *head,
            tokens=tuple((entry.seq_id, token.token_id) for entry, token in zip(sampling, drawn, strict=True)),
            logprobs=tuple(
                (entry.seq_id, token.logprobs) for entry, token in zip(sampling, drawn, strict=True) if token.logprobs is not None
            ),
            logits=tuple(
                (entry.seq_id, entry.position, logits[first : first + len(entry.token_ids)].cpu().numpy()) for entry, first in spans
            ),
        )

    def _prepare(self, adapters: list[str]) -> dict[str, int]:
        """The batch's adapters made resident (`LoraPool.prepare`); the decision and the slots
        afterwards (evictions included) go into the rank's slot digest."""
        slots = self.pool.prepare(adapters)
        self.slot_digest.update(repr((tuple(slots.items()), tuple(self.pool.slots))).encode())
        self.slot_decisions += 1
        return slots

    def _context(
        self, counts: list[int], all_slots: list[int], positions: list[int], attention: AttentionBatch, logit_rows: list[int] | None = None
    ) -> ForwardContext:
        """This rank's forward context: its group's tokens' adapter slots for attention, every
        group's for the MLP (which runs TP over all ranks), RoPE at the tokens' positions."""
        offset = sum(counts[: self.coords.attn_dp_rank])
        cos, sin = self.model.rope_tables(positions)
        mlp_lora = LoraBatch.from_token_slots(self._ids(all_slots))
        # Without DP attention the group's tokens are all tokens: one batch (and the views the
        # kernels derive from it once) serves attention and MLP alike.
        attn_lora = (
            mlp_lora
            if len(counts) == 1
            else LoraBatch.from_token_slots(self._ids(all_slots[offset : offset + counts[self.coords.attn_dp_rank]]))
        )
        return ForwardContext(
            group_token_counts=counts,
            attn_dp_rank=self.coords.attn_dp_rank,
            attn_tp_rank=self.coords.attn_tp_rank,
            attn_lora=attn_lora,
            mlp_lora=mlp_lora,
            cos=cos,
            sin=sin,
            attention=attention,
            logit_rows=None if logit_rows is None else self._ids(logit_rows),
        )

    def _ids(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def _module_name(key: tuple[int, str] | tuple[int, str, int]) -> str:
    """(layer, kind[, expert]) → "layers.L.kind" or "layers.L.experts.E.proj"."""
    if len(key) == 3:
        layer, kind, expert = key
        return f"layers.{layer}.experts.{expert}.{kind.split('.', 1)[1]}"
    return f"layers.{key[0]}.{key[1]}"


def _proc_file(name: str) -> bytes:
    """The text of /proc/self/NAME, read with one system call (b"" where there is none)."""
    try:
        fd = os.open(f"/proc/self/{name}", os.O_RDONLY)
    except OSError:
        return b""
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM of /proc/self/status, Linux), in bytes; 0 elsewhere."""
    status = _proc_file("status")
    at = status.find(b"\nVmHWM:")
    if at < 0:
        return 0
    return int(status[at + len(b"\nVmHWM:") : status.index(b"\n", at + 1)].split()[0]) * 1024


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark so a load's own peak can be measured; returns RSS now.

    Plain system calls, not pathlib, and statm, not status, for the RSS: this runs in every
    rank on every load, so it does the least work that gives the figure.
    """
    with contextlib.suppress(OSError):  # not Linux: the growth figure reads 0
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
        try:
            os.write(fd, b"5")
        finally:
            os.close(fd)
    fields = _proc_file("statm").split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") if len(fields) > 1 else 0


def rank_main(rank_config: RankConfig, rank: int, conn: Connection, faults: FaultPlan | None = None) -> None:
    """Entry point of a spawned rank process: start, report readiness, then serve commands."""
    logging.basicConfig(level=os.environ.get("LORAFLEET_LOG_LEVEL", "WARNING"), format=f"rank{rank} %(levelname)s %(name)s: %(message)s")
    config = rank_config.engine
    if config.device == "cpu":
        # Ranks share the machine's cores; oversubscription makes every collective wait (and on a
        # machine shared with other work, every OpenMP barrier of every small op: cpu_threads).
        torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 1) // config.topology.tp_size))
    try:
        worker = RankWorker(rank_config, rank, faults)
    except Exception as error:  # any startup failure is reported, then the rank exits
        log.debug("startup failed: %s", traceback.format_exc())
        coords = config.topology.coords(rank)
        conn.send(RankReply(rank, coords.attn_dp_rank, coords.attn_tp_rank, False, f"rank {rank} failed to start: {error}"))
        return
    conn.send(worker.ready())
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return  # the driver is gone
        # Replies are plain data: plain pickle, without the copy of its reducer tables that
        # Connection.send's ForkingPickler makes on every call.
        conn.send_bytes(pickle.dumps(worker.run(command), pickle.HIGHEST_PROTOCOL))
        if faults is not None:
            faults.answered(rank, type(command).__name__.lower())
        if isinstance(command, Shutdown):
            return
