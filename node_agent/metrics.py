"""Prometheus metrics of one node agent (prometheus_client).

Each agent has its own `CollectorRegistry`, so several agents in one process (tests) never
share or collide; `serve --metrics-port` exposes it over HTTP (and `--http-listen` at /metrics).

Beside lorafleet's own metrics, `ServingCollector` exports what inference gateways read (the
Gateway API Inference Extension's model-server protocol, in vLLM's names) and the scheduler's
counters, from the backend's `serving_stats()` at scrape time: no thread polls the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node_agent.adapter_metrics import AdapterRequestMetrics
from node_agent.backend import ServingStats

log = logging.getLogger(__name__)

# Loads range from milliseconds (cached, tiny) to minutes (multi-GiB downloads).
CONTROL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
INFERENCE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class BudgetState(Protocol):
    """A call budget as its gauges read it (the gRPC server's `CallBudget`)."""

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...


class StandbyMemoryState(Protocol):
    """The host-memory tier of standby snapshots as its gauges read it (`StandbyMemory`)."""

    @property
    def bytes_held(self) -> int: ...

    @property
    def adapters_held(self) -> int: ...


class AgentMetrics:
    """Every metric the agent exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.load_seconds = Histogram(
            "lorafleet_agent_adapter_load_seconds",
            "LoadAdapter latency by outcome (ok, or the failure reason)",
            ["outcome"],
            buckets=CONTROL_BUCKETS,
            registry=r,
        )
        self.unload_seconds = Histogram(
            "lorafleet_agent_adapter_unload_seconds",
            "UnloadAdapter latency (including the drain) by outcome",
            ["outcome"],
            buckets=CONTROL_BUCKETS,
            registry=r,
        )
        self.failures = Counter("lorafleet_agent_failures", "Failed calls by operation and reason", ["operation", "reason"], registry=r)
        self.loaded_adapters = Gauge("lorafleet_agent_loaded_adapters", "Adapters routable on this agent", registry=r)
        self.requests = Counter(
            "lorafleet_agent_inference_requests", "Forward/Generate calls by method and outcome", ["method", "outcome"], registry=r
        )
        self.request_seconds = Histogram(
            "lorafleet_agent_inference_seconds",
            "Forward/Generate latency (whole stream for Generate)",
            ["method"],
            buckets=INFERENCE_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter("lorafleet_agent_generated_tokens", "Tokens streamed by Generate", registry=r)
        self.engine_up = Gauge("lorafleet_agent_engine_up", "1 while every rank of the engine is alive", registry=r)
        self.calls_running = Gauge(
            "lorafleet_agent_calls_running", "Calls holding a place of their budget (control, inference)", ["budget"], registry=r
        )
        self.calls_waiting = Gauge(
            "lorafleet_agent_calls_waiting", "Calls waiting in their budget's queue for a place (not yet admitted)", ["budget"], registry=r
        )
        self.lora_load_seconds = Histogram(
            "vllm:lora_adapter_load_seconds",
            "Loads of a standby adapter onto the backend's ranks (its first request, or a LoadAdapter that wants it resident)",
            buckets=CONTROL_BUCKETS,
            registry=r,
        )
        self.standby_memory_bytes = Gauge(
            "lorafleet_agent_standby_memory_bytes",
            "Bytes of standby adapters' snapshots held in host memory (--standby-memory-mib), copies being written included",
            registry=r,
        )
        self.standby_memory_adapters = Gauge(
            "lorafleet_agent_standby_memory_adapters", "Adapter versions whose snapshot has a copy in host memory", registry=r
        )
        self.adapters = AdapterRequestMetrics(r)

    def watch_budget(self, name: str, budget: BudgetState) -> None:
        """Export a call budget's places taken and queue, read at scrape time."""
        self.calls_running.labels(name).set_function(lambda: budget.running)
        self.calls_waiting.labels(name).set_function(lambda: budget.waiting)

    def watch_standby_memory(self, tier: StandbyMemoryState) -> None:
        """Export the host-memory tier's bytes and adapters, read at scrape time."""
        self.standby_memory_bytes.set_function(lambda: tier.bytes_held)
        self.standby_memory_adapters.set_function(lambda: tier.adapters_held)

    def serve_engine(self, stats: Callable[[], ServingStats], public_name: Callable[[str], str], max_lora: int) -> None:
        """Export the engine's serving state (`ServingCollector`) with the other metrics."""
        self.registry.register(ServingCollector(stats, public_name, max_lora))


class ServingCollector(Collector):
    """The gateway metrics and the scheduler's counters, read from the engine at scrape time.

    * `vllm:num_requests_waiting` / `vllm:num_requests_running`: sequences queued and scheduled
      (every DP group together);
    * `vllm:kv_cache_usage_perc`: used KV blocks over all blocks of every DP group, 0 to 1;
    * `vllm:lora_requests_info`: value the scrape's Unix time (gateways keep the newest sample),
      labels `running_lora_adapters` / `waiting_lora_adapters` (the public names, comma-separated,
      sorted) and `max_lora` (the device LoRA slots a batch can use, --max-loras-per-batch);
    * `vllm:cache_config_info`: value 1, labels `block_size` and `num_gpu_blocks` of each DP
      group's KV cache (`engine`, the group, as vLLM labels each engine core); only for a
      backend that keeps a KV cache of its own;
    * `lorafleet_engine_steps_total` / `lorafleet_engine_preemptions_total`, and free KV blocks
      per DP group.
    """

    def __init__(self, stats: Callable[[], ServingStats], public_name: Callable[[str], str], max_lora: int) -> None:
        self._stats = stats
        self._public_name = public_name
        self._max_lora = max_lora

    def describe(self) -> Iterable[Metric]:
        return []  # the families are known only at scrape time; registering must not read the engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must never fail the endpoint: the other metrics still answer
            log.warning("serving stats unavailable for this scrape", exc_info=True)
            return
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled", value=stats.waiting)
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests running (scheduled on the engine)", value=stats.running)
        total = stats.num_blocks * len(stats.free_blocks)
        used = total - sum(stats.free_blocks)
        yield GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1 (1 = every block used)", value=used / total if total else 0.0
        )
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters of running and waiting requests (value: time of the scrape)",
            labels=("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
        )
        info.add_metric((self._names(stats.running_adapters), self._names(stats.waiting_adapters), str(self._max_lora)), time.time())
        yield info
        if stats.block_size and stats.num_blocks:
            yield _cache_config_info(stats)
        yield CounterMetricFamily("lorafleet_engine_steps", "Steps the engine's ranks ran", value=stats.steps)
        yield CounterMetricFamily("lorafleet_engine_preemptions", "Sequences preempted by recompute", value=stats.preemptions)
        free = GaugeMetricFamily("lorafleet_engine_kv_blocks_free", "Free KV blocks per DP group", labels=("dp_group",))
        for group, blocks in enumerate(stats.free_blocks):
            free.add_metric((str(group),), blocks)
        yield free
        yield GaugeMetricFamily("lorafleet_engine_kv_blocks", "KV blocks per DP group", value=stats.num_blocks)

    def _names(self, engine_names: frozenset[str]) -> str:
        return ",".join(sorted({self._public_name(name) for name in engine_names}))


def _cache_config_info(stats: ServingStats) -> GaugeMetricFamily:
    """vLLM's info gauge of its cache config: 1, the config in the labels."""
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the engine's KV cache config", labels=("block_size", "engine", "num_gpu_blocks")
    )
    for group in range(len(stats.free_blocks)):
        info.add_metric((str(stats.block_size), str(group), str(stats.num_blocks)), 1)
    return info


class MetricsEndpoint:
    """An HTTP endpoint serving one agent's metrics; closed by whoever opened it."""

    def __init__(self, metrics: AgentMetrics, port: int, addr: str = "0.0.0.0") -> None:
        self._httpd, _thread = start_http_server(port, addr=addr, registry=metrics.registry)
        self.port = int(self._httpd.server_address[1])  # the bound port (port 0: any free one)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
