"""Prometheus metrics of one node agent (prometheus_client).

Each agent has its own `CollectorRegistry`, so several agents in one process (tests) never
share or collide; `serve --metrics-port` exposes it over HTTP.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Loads range from milliseconds (cached, tiny) to minutes (multi-GiB downloads).
CONTROL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
INFERENCE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class AgentMetrics:
    """Every metric the agent exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.load_seconds = Histogram(
            "lorafleet_agent_adapter_load_seconds", "LoadAdapter latency by outcome (ok, or the failure reason)",
            ["outcome"], buckets=CONTROL_BUCKETS, registry=r)
        self.unload_seconds = Histogram(
            "lorafleet_agent_adapter_unload_seconds", "UnloadAdapter latency (including the drain) by outcome",
            ["outcome"], buckets=CONTROL_BUCKETS, registry=r)
        self.failures = Counter(
            "lorafleet_agent_failures", "Failed calls by operation and reason", ["operation", "reason"], registry=r)
        self.loaded_adapters = Gauge("lorafleet_agent_loaded_adapters", "Adapters routable on this agent", registry=r)
        self.requests = Counter(
            "lorafleet_agent_inference_requests", "Forward/Generate calls by method and outcome", ["method", "outcome"], registry=r)
        self.request_seconds = Histogram(
            "lorafleet_agent_inference_seconds", "Forward/Generate latency (whole stream for Generate)",
            ["method"], buckets=INFERENCE_BUCKETS, registry=r)
        self.generated_tokens = Counter("lorafleet_agent_generated_tokens", "Tokens streamed by Generate", registry=r)
        self.engine_up = Gauge("lorafleet_agent_engine_up", "1 while every rank of the engine is alive", registry=r)



class MetricsEndpoint:
    """An HTTP endpoint serving one agent's metrics; closed by whoever opened it."""

    def __init__(self, metrics: AgentMetrics, port: int, addr: str = "0.0.0.0") -> None:
        self._httpd, _thread = start_http_server(port, addr=addr, registry=metrics.registry)
        self.port = int(self._httpd.server_address[1])  # the bound port (port 0: any free one)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
