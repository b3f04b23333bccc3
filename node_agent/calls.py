"""Call bookkeeping: each call's metrics and, for control calls, one structured log line.

A call is a context manager around the agent's work: its outcome is "ok", the `reason` of the
`AgentError` that ended it, or "internal" for anything else (docs/agent.md "Metrics and logs").
"""

from __future__ import annotations

import json
import logging
import time
from types import TracebackType

from node_agent.engine import ControlResult
from node_agent.errors import AgentError
from node_agent.metrics import AgentMetrics
from node_agent.sources import redact_uri

call_log = logging.getLogger("lorafleet.agent.calls")


class ControlCall:
    """Times one LoadAdapter/UnloadAdapter; records its metric, failure reason and log line."""

    def __init__(self, metrics: AgentMetrics, operation: str, adapter: str, source: str | None = None) -> None:
        self.metrics, self.operation, self.adapter = metrics, operation, adapter
        # A source URI is logged redacted: never its userinfo or query (they may hold secrets).
        self.fields = {} if source is None else {"source": redact_uri(source)}
        self.outcome = "ok"
        self.error = ""
        self.already_loaded = False
        self.started = 0.0

    def result(self, result: ControlResult, reason: str = "rank_failed") -> ControlResult:
        """Record the ranks' answer (a refusal by the ranks is outcome `reason`, "rank_failed"
        unless the caller knows better); returns it."""
        if not result.ok:
            self.outcome, self.error = reason, result.error
        self.already_loaded = result.already_loaded
        return result

    def __enter__(self) -> ControlCall:
        self.started = time.monotonic()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, AgentError):
            self.outcome, self.error = exc.reason, str(exc)
        elif exc is not None:
            self.outcome, self.error = "internal", f"{type(exc).__name__}: {exc}"
        duration = time.monotonic() - self.started
        histogram = self.metrics.load_seconds if self.operation == "load" else self.metrics.unload_seconds
        histogram.labels(self.outcome).observe(duration)
        if self.outcome != "ok":
            self.metrics.failures.labels(self.operation, self.outcome).inc()
        line = {
            "call": self.operation,
            "adapter": self.adapter,
            "outcome": self.outcome,
            "duration_ms": round(duration * 1000, 1),
            **self.fields,
        }
        if self.operation == "load":
            line["already_loaded"] = self.already_loaded
        if self.error:
            line["error"] = self.error
        call_log.log(logging.INFO if self.outcome == "ok" else logging.WARNING, json.dumps(line, sort_keys=True))


class InferenceCall:
    """Counts and times one Forward/Generate by outcome (a Generate: its whole stream)."""

    def __init__(self, metrics: AgentMetrics, method: str) -> None:
        self.metrics, self.method = metrics, method
        self.outcome = "ok"
        self.started = 0.0

    def __enter__(self) -> InferenceCall:
        self.started = time.monotonic()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, AgentError):
            self.outcome = exc.reason
        elif isinstance(exc, GeneratorExit):
            self.outcome = "cancelled"  # the caller stopped reading the stream
        elif exc is not None:
            self.outcome = "internal"
        self.metrics.requests.labels(self.method, self.outcome).inc()
        self.metrics.request_seconds.labels(self.method).observe(time.monotonic() - self.started)
        if self.outcome not in ("ok", "cancelled"):
            self.metrics.failures.labels(self.method, self.outcome).inc()
