"""Prometheus metrics of the operator (served on LORAFLEET_METRICS_PORT).

Counters of reconciles and agent calls let a test (or an alert) tell a steady state from a hot
loop: a permanently failing adapter must not keep ``lorafleet_agent_calls_total`` rising.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("lorafleet_reconciles_total", "LoraAdapter reconciles, by trigger and resulting phase.", ["trigger", "phase"])
RECONCILE_SECONDS = Histogram("lorafleet_reconcile_seconds", "Duration of one LoraAdapter reconcile.", ["trigger"])
AGENT_CALLS = Counter("lorafleet_agent_calls_total", "gRPC calls to node agents, by method and status code.", ["method", "code"])
DRIFT_REPAIRS = Counter(
    "lorafleet_drift_repairs_total",
    "Registry repairs by the drift check: load (an agent lacked a wanted adapter) or unload (an agent held one no resource wants).",
    ["action"],
)
DRIFT_CHECKS = Counter("lorafleet_drift_checks_total", "Completed drift checks of a fleet.")
LEADER = Gauge("lorafleet_leader", "1 while this replica holds the leader lease.")
UNUSABLE_NAMESPACES = Gauge(
    "lorafleet_unusable_namespaces",
    "Watched namespaces found missing (still watched) or forbidden (skipped) at start-up.",
    ["namespace", "problem"],
)
STATUS_REFUSED = Counter(
    "lorafleet_status_refused_total", "Status patches the API server refused (schema or size); each is sent only once.", ["kind"]
)
KUBE_REQUESTS = Counter(
    "lorafleet_kube_requests_total",
    "Kubernetes API requests made outside kopf's own (kube.py), by the client call "
    "(e.g. list_namespaced_endpoint_slice), whatever their outcome.",
    ["call"],
)
DESIRED_REPLICAS = Gauge(
    "lorafleet_adapter_desired_replicas",
    "Replicas of a demand-scaled LoraAdapter (spec.scaling) as last decided from its demand.",
    ["namespace", "adapter"],
)
CURRENT_REPLICAS = Gauge(
    "lorafleet_adapter_current_replicas",
    "Agents whose registry held a demand-scaled LoraAdapter at its last scaling decision.",
    ["namespace", "adapter"],
)
SCALING_DECISIONS = Counter(
    "lorafleet_scaling_decisions_total",
    "Changes of a demand-scaled LoraAdapter's desired replicas, by direction (up, down).",
    ["direction"],
)
