"""Which adapters the agent holds, and where, in the names of vLLM's residency metrics.

vLLM's open pull request #54830 ("Publish LoRA load events and expose loaded adapters in
metrics", https://github.com/vllm-project/vllm/pull/54830) names them, and llm-d-router's
`lora-load-state-scorer` (llm-d/llm-d-router#2792) reads them to route on residency rather
than on requests in flight:

* `vllm:lora_adapter_loaded{adapter_name,level,pinned,rank}`: 1 for each routable adapter:
  `level="gpu"` when the backend holds it on its ranks (it serves at once), `"cpu"` when it is
  on standby (its verified snapshot kept; its first request loads it, `node_agent.residency`);
  `pinned` `"true"` or `"false"`; `rank` the adapter's LoRA rank (`r` of its config);
* `vllm:num_gpu_loaded_lora_adapters`: adapter versions the backend holds (a replaced version
  still draining counts until it is unloaded, as it holds its place);
* `vllm:max_gpu_lora_adapters`: how many it can hold (`--max-loaded-loras`); below it a standby
  adapter loads without evicting another.

Read from the registry at scrape time (no thread polls). The load histogram,
`vllm:lora_adapter_load_seconds`, is observed where loads happen (`AgentMetrics`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node_agent.engine import AdapterLoadError, read_adapter_config
from node_agent.metrics import AgentMetrics
from node_agent.registry import AdapterEntry, Registry


class ResidencyCollector(Collector):
    """The residency metrics of one agent's registry (the module docstring's)."""

    def __init__(self, registry: Registry, max_loaded: int) -> None:
        self._registry = registry
        self._max_loaded = max_loaded
        self._lock = threading.Lock()
        self._ranks: dict[str, str] = {}  # engine name -> LoRA rank: each version's config is read once

    def describe(self) -> Iterable[Metric]:
        return []  # read at scrape time only

    def collect(self) -> Iterator[Metric]:
        entries = self._registry.entries()
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded",
            "LoRA adapters loaded: level gpu (held by the backend's ranks) or cpu (on standby, snapshot kept)",
            labels=("adapter_name", "level", "pinned", "rank"),
        )
        for entry in entries:
            level = "cpu" if entry.standby else "gpu"
            loaded.add_metric((entry.name, level, str(entry.pinned).lower(), self._rank(entry)), 1)
        yield loaded
        yield GaugeMetricFamily(
            "vllm:num_gpu_loaded_lora_adapters", "LoRA adapters the backend's ranks hold", value=len(self._registry.held())
        )
        yield GaugeMetricFamily("vllm:max_gpu_lora_adapters", "LoRA adapters the backend's ranks can hold", value=self._max_loaded)
        self._forget_all_but(entry.engine_name for entry in entries)

    def _rank(self, entry: AdapterEntry) -> str:
        """The adapter's LoRA rank, "" when its snapshot's config cannot be read now."""
        with self._lock:
            rank = self._ranks.get(entry.engine_name)
        if rank is not None:
            return rank
        try:
            rank = str(read_adapter_config(entry.source.path).r)
        except (AdapterLoadError, OSError):  # the version was retired under the scrape
            return ""
        with self._lock:
            self._ranks[entry.engine_name] = rank
        return rank

    def _forget_all_but(self, engine_names: Iterable[str]) -> None:
        keep = set(engine_names)
        with self._lock:
            for gone in set(self._ranks) - keep:
                del self._ranks[gone]


def serve_residency(metrics: AgentMetrics, registry: Registry, max_loaded: int) -> None:
    """Export the registry's residency with the agent's other metrics."""
    metrics.registry.register(ResidencyCollector(registry, max_loaded))
