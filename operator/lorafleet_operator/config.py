"""Operator settings, read once from the environment (the chart sets these; see values.yaml).

Everything that tests need to shorten (drift interval, retry back-offs, deadlines) lives here,
so the operator's behaviour is the same in tests and in production, only faster.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

GROUP = "lorafleet.dev"
VERSION = "v1alpha1"
ADAPTERS = "loraadapters"
FLEETS = "lorafleets"
FINALIZER = "lorafleet.dev/unload"
#: Prefix of kopf's own bookkeeping annotations (handler progress, last-handled spec).
ANNOTATION_PREFIX = "lorafleet.dev"


def _float(env: dict[str, str], key: str, default: float) -> float:
    raw = env.get(key, "").strip()
    return float(raw) if raw else default


def _int(env: dict[str, str], key: str, default: int) -> int:
    raw = env.get(key, "").strip()
    return int(raw) if raw else default


@dataclass(frozen=True)
class Settings:
    """What one operator process does and how fast; built by :func:`from_env`."""

    namespaces: tuple[str, ...] = ()
    lease_name: str = "lorafleet-operator"
    lease_namespace: str = "default"
    lease_duration_s: float = 15.0
    identity: str = field(default_factory=socket.gethostname)
    log_level: str = "INFO"
    metrics_port: int = 0
    #: Seconds between registry-consistency checks of one fleet.
    drift_interval_s: float = 30.0
    #: First delay before a permanently failed (adapter, agent) load is tried again by the
    #: drift check; doubled per attempt up to ``failed_retry_max_s``. Not a hot loop.
    failed_retry_s: float = 300.0
    failed_retry_max_s: float = 3600.0
    #: kopf retry delays for transient errors: base * 2**retry, capped.
    transient_retry_s: float = 2.0
    transient_retry_max_s: float = 60.0
    #: Deadline of one control call (LoadAdapter, UnloadAdapter) and of the quick ones.
    load_deadline_s: float = 120.0
    call_deadline_s: float = 10.0
    #: Concurrent gRPC calls per agent, and in all.
    per_agent_concurrency: int = 4
    total_concurrency: int = 32
    #: Deletion gives up on unreachable (but still Ready) agents after this many retries;
    #: the drift check unloads the orphan later, when the agent answers again.
    delete_retries: int = 5

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """Read ``LORAFLEET_*`` variables (and POD_NAME for the lease identity)."""
        env = dict(os.environ if env is None else env)
        lease_ns = env.get("LORAFLEET_LEASE_NAMESPACE", "").strip() or "default"
        namespaces = tuple(
            n.strip() for n in env.get("LORAFLEET_WATCH_NAMESPACES", "").split(",") if n.strip()
        ) or (lease_ns,)
        return cls(
            namespaces=namespaces,
            lease_name=env.get("LORAFLEET_LEASE_NAME", "").strip() or "lorafleet-operator",
            lease_namespace=lease_ns,
            lease_duration_s=_float(env, "LORAFLEET_LEASE_DURATION_SECONDS", 15.0),
            identity=env.get("POD_NAME", "").strip() or f"{socket.gethostname()}-{os.getpid()}",
            log_level=env.get("LORAFLEET_LOG_LEVEL", "").strip().upper() or "INFO",
            metrics_port=_int(env, "LORAFLEET_METRICS_PORT", 0),
            drift_interval_s=_float(env, "LORAFLEET_DRIFT_INTERVAL_SECONDS", 30.0),
            failed_retry_s=_float(env, "LORAFLEET_FAILED_RETRY_SECONDS", 300.0),
            failed_retry_max_s=_float(env, "LORAFLEET_FAILED_RETRY_MAX_SECONDS", 3600.0),
            transient_retry_s=_float(env, "LORAFLEET_TRANSIENT_RETRY_SECONDS", 2.0),
            transient_retry_max_s=_float(env, "LORAFLEET_TRANSIENT_RETRY_MAX_SECONDS", 60.0),
            load_deadline_s=_float(env, "LORAFLEET_LOAD_DEADLINE_SECONDS", 120.0),
            call_deadline_s=_float(env, "LORAFLEET_CALL_DEADLINE_SECONDS", 10.0),
            per_agent_concurrency=_int(env, "LORAFLEET_PER_AGENT_CONCURRENCY", 4),
            total_concurrency=_int(env, "LORAFLEET_TOTAL_CONCURRENCY", 32),
            delete_retries=_int(env, "LORAFLEET_DELETE_RETRIES", 5),
        )

    def transient_delay(self, retry: int) -> float:
        """kopf retry delay after ``retry`` earlier failures: exponential, capped."""
        return min(self.transient_retry_s * 2 ** min(retry, 20), self.transient_retry_max_s)

    def failed_delay(self, attempts: int) -> float:
        """Drift-check delay before the next try of a permanently failed load."""
        return min(self.failed_retry_s * 2 ** min(max(attempts - 1, 0), 20),
                   self.failed_retry_max_s)
