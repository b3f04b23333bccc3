"""Per-adapter request metrics (Prometheus), with a bounded set of `adapter` label values.

Requests, prompt and generated tokens, time to first token and inter-token latency, each
labelled by the adapter's public name (`BASE_LABEL` for the base model). A request counts once
its first token is streamed: only then was its adapter routable, so names that no adapter has
(a client's typo, a scan) never become label values.

At most `max_adapters` adapters have a label of their own; the requests of any further adapter
are counted under `OTHER_LABEL` until a labelled adapter is unloaded and frees its place (its
series are removed). An `other` bucket, not a drop: the per-adapter series always add up to the
agent's whole traffic, while the number of series stays bounded whatever the number of
adapters. Both special values start with `_`, which no adapter name can (lorafleet_common's
adapter-name rule), so they never collide with an adapter.
"""

from __future__ import annotations

import threading
from contextlib import suppress

from prometheus_client import CollectorRegistry, Counter, Histogram

#: The label value of the base model's requests.
BASE_LABEL = "_base"
#: The label value of the requests of adapters beyond the cap.
OTHER_LABEL = "_other"
#: How many adapters have a label of their own by default.
DEFAULT_MAX_ADAPTER_LABELS = 64

# vLLM's buckets for the same measures (vllm:time_to_first_token_seconds,
# vllm:inter_token_latency_seconds), so dashboards compare them directly.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)


class AdapterRequestMetrics:
    """The per-adapter request metrics of one agent's registry; safe from many threads."""

    def __init__(self, registry: CollectorRegistry, max_adapters: int = DEFAULT_MAX_ADAPTER_LABELS) -> None:
        if max_adapters < 0:
            raise ValueError(f"max_adapters must be at least 0, got {max_adapters}")
        self.max_adapters = max_adapters
        self._lock = threading.Lock()
        self._labelled: set[str] = set()
        label = ["adapter"]
        self.requests = Counter(
            "lorafleet_agent_adapter_requests", "Generate requests that streamed a first token", label, registry=registry
        )
        self.prompt_tokens = Counter("lorafleet_agent_adapter_prompt_tokens", "Prompt tokens of those requests", label, registry=registry)
        self.generated_tokens = Counter("lorafleet_agent_adapter_generated_tokens", "Tokens streamed", label, registry=registry)
        self.time_to_first_token = Histogram(
            "lorafleet_agent_adapter_time_to_first_token_seconds",
            "From the agent taking the request to its first token",
            label,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "lorafleet_agent_adapter_inter_token_latency_seconds",
            "Between two tokens of one request",
            label,
            buckets=ITL_BUCKETS,
            registry=registry,
        )

    def label(self, adapter: str) -> str:
        """The label value of `adapter` ("": the base model), taking a free place if it has none."""
        if not adapter:
            return BASE_LABEL
        with self._lock:
            if adapter in self._labelled:
                return adapter
            if len(self._labelled) < self.max_adapters:
                self._labelled.add(adapter)
                return adapter
        return OTHER_LABEL

    def first_token(self, label: str, prompt_tokens: int, ttft_s: float) -> None:
        """A request's first token, `ttft_s` after the agent took it."""
        self.requests.labels(label).inc()
        self.prompt_tokens.labels(label).inc(prompt_tokens)
        self.generated_tokens.labels(label).inc()
        self.time_to_first_token.labels(label).observe(ttft_s)

    def next_token(self, label: str, gap_s: float) -> None:
        """A later token of a request, `gap_s` after the one before."""
        self.generated_tokens.labels(label).inc()
        self.inter_token_latency.labels(label).observe(gap_s)

    def forget(self, adapter: str) -> None:
        """Remove an unloaded adapter's series and free its place (a later adapter may take it)."""
        with self._lock:
            if adapter not in self._labelled:
                return
            self._labelled.discard(adapter)
            for metric in (self.requests, self.prompt_tokens, self.generated_tokens, self.time_to_first_token, self.inter_token_latency):
                with suppress(KeyError):  # labelled, but not every series has a sample yet
                    metric.remove(adapter)
