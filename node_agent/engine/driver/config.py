"""How an engine is built (`EngineConfig`, the one place its defaults are written) and what each
rank is started with (`RankConfig`: the driver's config itself, plus what the driver decided)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from node_agent.engine.parallel.topology import Topology


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine; the CLI flags map one to one onto these fields, and their
    defaults are these."""

    model_dir: Path
    topology: Topology
    max_lora_rank: int = 16
    max_loras_per_batch: int = 4
    max_loaded_loras: int = 32
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    master_port: int = 0  # the ranks' rendezvous on loopback, served by the driver (0: a port the kernel picks)
    startup_timeout_s: float = 300.0
    call_timeout_s: float = 300.0
    # Serving (docs/serving.md): each rank's KV cache budget, tokens per block, the scheduler's
    # per-step limits (over all DP groups), its waiting queue, and prefix caching.
    kv_cache_bytes: int = 64 << 20
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    prefix_caching: bool = False
    # torch threads of each CPU rank; None: the machine's cores divided by tp. Fewer help on a
    # machine shared with other work, where every OpenMP barrier waits for a descheduled thread.
    cpu_threads: int | None = None
    # On CUDA, each rank's KV budget from device memory instead of kv_cache_bytes: the engine may
    # use this fraction of the device (vLLM's --gpu-memory-utilization); None: kv_cache_bytes.
    gpu_memory_utilization: float | None = None

    @property
    def torch_dtype_name(self) -> str:
        """The ranks' dtype: `dtype`, or float32 on CPU and bfloat16 on CUDA."""
        return self.dtype or ("float32" if self.device == "cpu" else "bfloat16")


@dataclass(frozen=True)
class RankConfig:
    """What a rank needs to start: the driver's config and the rendezvous store the driver
    serves (`distributed.rendezvous_store`); plain data, so it pickles into a spawned process."""

    engine: EngineConfig
    store_port: int
