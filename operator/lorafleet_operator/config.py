"""Operator settings, read once from the environment (the chart sets these; see values.yaml).

Everything that tests need to shorten (drift interval, retry back-offs, deadlines) lives here,
so the operator's behaviour is the same in tests and in production, only faster.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any

GROUP = "lorafleet.dev"
VERSION = "v1alpha1"
ADAPTERS = "loraadapters"
FLEETS = "lorafleets"
FINALIZER = "lorafleet.dev/unload"
#: Prefix of kopf's own bookkeeping annotations (handler progress, last-handled spec).
ANNOTATION_PREFIX = "lorafleet.dev"


@dataclass(frozen=True)
class Settings:
    """What one operator process does and how fast; built by :func:`from_env`."""

    namespaces: tuple[str, ...] = ()
    lease_name: str = "lorafleet-operator"
    lease_namespace: str = "default"
    lease_duration_s: float = 15.0
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    log_level: str = "INFO"
    metrics_port: int = 0
    #: kopf's liveness endpoint (``/healthz``; 0: off): fails when a drift loop is wedged.
    health_port: int = 0
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
    #: Loads of local sources waiting for one agent that go in one LoadAdapters call, at most
    #: (1: one LoadAdapter call each). They share one call's deadline (``load_deadline_s``),
    #: so the agent must finish them all within it; an agent takes at most 64 per call.
    load_batch: int = 8
    #: Concurrent loads of remote (http(s)) sources per agent and namespace, apart from the
    #: bounds above: downloads of one tenant never hold the call slots others need.
    remote_loads_per_namespace: int = 2
    #: Deletion gives up on unreachable (but still Ready) agents after this many retries;
    #: the drift check unloads the orphan later, when the agent answers again.
    delete_retries: int = 5
    #: Agent processes that may die or hang during loads of one adapter generation before
    #: the generation is Failed (LoadCrashedAgent) and sent to no agent until the spec changes.
    load_crash_budget: int = 2

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read ``LORAFLEET_*`` variables (and POD_NAME for the lease identity); a variable
        that is unset or empty keeps the field's default."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_VARS.get(f.name, ""), "").strip()
            if raw:
                values[f.name] = _parse(f, raw)
        settings = cls(**values)
        if not settings.namespaces:  # by default, manage the namespace the lease lives in
            settings = replace(settings, namespaces=(settings.lease_namespace,))
        return settings


#: The environment variable of each setting (docs/operator.md lists them with their defaults).
ENV_VARS = {
    "namespaces": "LORAFLEET_WATCH_NAMESPACES",
    "lease_name": "LORAFLEET_LEASE_NAME",
    "lease_namespace": "LORAFLEET_LEASE_NAMESPACE",
    "lease_duration_s": "LORAFLEET_LEASE_DURATION_SECONDS",
    "identity": "POD_NAME",
    "log_level": "LORAFLEET_LOG_LEVEL",
    "metrics_port": "LORAFLEET_METRICS_PORT",
    "health_port": "LORAFLEET_HEALTH_PORT",
    "drift_interval_s": "LORAFLEET_DRIFT_INTERVAL_SECONDS",
    "failed_retry_s": "LORAFLEET_FAILED_RETRY_SECONDS",
    "failed_retry_max_s": "LORAFLEET_FAILED_RETRY_MAX_SECONDS",
    "transient_retry_s": "LORAFLEET_TRANSIENT_RETRY_SECONDS",
    "transient_retry_max_s": "LORAFLEET_TRANSIENT_RETRY_MAX_SECONDS",
    "load_deadline_s": "LORAFLEET_LOAD_DEADLINE_SECONDS",
    "call_deadline_s": "LORAFLEET_CALL_DEADLINE_SECONDS",
    "per_agent_concurrency": "LORAFLEET_PER_AGENT_CONCURRENCY",
    "total_concurrency": "LORAFLEET_TOTAL_CONCURRENCY",
    "load_batch": "LORAFLEET_LOAD_BATCH",
    "remote_loads_per_namespace": "LORAFLEET_REMOTE_LOADS_PER_NAMESPACE",
    "delete_retries": "LORAFLEET_DELETE_RETRIES",
    "load_crash_budget": "LORAFLEET_LOAD_CRASH_BUDGET",
}


def _names(raw: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in raw.split(",") if n.strip())


#: How a variable's text becomes a value, by the field's declared type.
_PARSERS: dict[str, Callable[[str], object]] = {
    "str": str,
    "int": int,
    "float": float,
    "tuple[str, ...]": _names,
}


def _parse(f: Field[Any], raw: str) -> object:
    return _PARSERS[str(f.type)](raw)
