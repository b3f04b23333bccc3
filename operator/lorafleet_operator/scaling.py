"""Scaling by demand (docs/scaling.md): at each drift check, before placement, the fleet's
agents are asked for their demand (AdapterStats, all at once), each demand-scaled LoraAdapter
(``spec.scaling``) gets its replicas from :func:`~lorafleet_operator.demand.decide`, and the
fleet's slots are shared by demand (:func:`~lorafleet_operator.demand.share_slots`). Placement
(:mod:`~lorafleet_operator.placing`) then places the replicas granted, as it places a fixed
``spec.replicas``: the one rule, sticky.

Demand is unknown, never zero, when an agent that holds the adapter (or whose registry is
unknown) did not answer: the replicas then stay as they were. Each change of the replicas
decided is a Kubernetes Event (``ScaledUp`` / ``ScaledDown``, from → to and the demand), a
metric, and ``status.scaling``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from lorafleet_operator import metrics
from lorafleet_operator.agent_values import AgentDemand, AgentError, AgentInfo
from lorafleet_operator.conditions import now_rfc3339
from lorafleet_operator.demand import (
    AdapterScaling,
    LimitKind,
    ScaleUpLimit,
    ScalingDecision,
    ScalingPolicy,
    ScalingState,
    SlotClaim,
    decide,
    share_slots,
    smoothed_demand,
)
from lorafleet_operator.fanout import ask_each
from lorafleet_operator.publish import post_event
from lorafleet_operator.resources import AdapterObject, ScalingMetric, ScalingSpec
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.view import FleetView, Registry

log = logging.getLogger("lorafleet.operator.scaling")

#: What each agent said of its demand (by pod), or the error that stands for it.
Samples = Mapping[str, AgentDemand | AgentError]


def policy_of(spec: ScalingSpec) -> ScalingPolicy:
    """``spec.scaling`` as the decision's policy."""
    limit = ScaleUpLimit(LimitKind.REPLICAS, spec.scale_up_replicas, float(spec.scale_up_period_s))
    return ScalingPolicy(spec.min_replicas, spec.max_replicas, spec.per_replica, float(spec.scale_down_window_s), (limit,))


def holders(name: str, registries: Mapping[str, Registry]) -> int:
    """Agents whose registry lists ``name`` resident (on standby it holds no slot)."""
    return sum(1 for registry in registries.values() if isinstance(registry, Mapping) and name in registry and not registry[name].standby)


def demand_of(name: str, metric: ScalingMetric, samples: Samples, registries: Mapping[str, Registry]) -> float | None:
    """The adapter's demand summed over the agents, in ``metric``'s unit; None (unknown) when
    an agent that holds it, or whose registry is unknown, did not answer."""
    total = 0.0
    for pod, sample in samples.items():
        if isinstance(sample, AgentError):
            registry = registries.get(pod)
            if not isinstance(registry, Mapping) or name in registry:
                return None
            continue
        stat = sample.adapters.get(name)
        if stat is not None:
            total += stat.running + stat.waiting if metric is ScalingMetric.REQUESTS else stat.tokens_per_s
    return total


def slots_for(view: FleetView, registries: Mapping[str, Registry], base_model: str, scaled: frozenset[str]) -> int:
    """The slots demand-scaled adapters of ``base_model`` share: on each agent that serves it
    and answered, ``max_loaded_loras`` less the resident names it holds that are not among them."""
    slots = 0
    for agent in view.dialable:
        info, registry = view.infos.get(agent.name), registries.get(agent.name)
        if isinstance(info, AgentInfo) and info.base_model == base_model and isinstance(registry, Mapping):
            taken = sum(1 for name, entry in registry.items() if name not in scaled and not entry.standby)
            slots += max(0, info.max_loaded_loras - taken)
    return slots


@dataclass(frozen=True)
class Scaled:
    """A demand-scaled adapter and its ``spec.scaling``."""

    adapter: AdapterObject
    spec: ScalingSpec

    @property
    def name(self) -> str:
        return self.adapter.agent_name


@dataclass(frozen=True)
class Decided:
    """One adapter's decision this round: the adapter, the decision (None: demand unknown,
    nothing decided), and the agents holding it."""

    scaled: Scaled
    decision: ScalingDecision | None
    current: int


def decide_one(
    scaled: Scaled, entry: AdapterScaling | None, demand: float | None, current: int, now: float
) -> tuple[AdapterScaling, Decided]:
    """The adapter's new book entry and decision (its demand unknown: the entry unchanged)."""
    adapter, spec = scaled.adapter, scaled.spec
    if entry is None or entry.uid != adapter.uid:
        entry = AdapterScaling(adapter.uid, ScalingState(), spec.min_replicas, spec.min_replicas)
    if demand is None:
        return entry, Decided(scaled, None, current)
    try:
        policy = policy_of(spec)
    except ValueError as err:  # the CRD refuses such a spec; one that got past it fails alone
        log.warning("scaling: %s/%s: spec.scaling is not usable: %s", adapter.namespace, adapter.name, err)
        return entry, Decided(scaled, None, current)
    if entry.sampled_at is None:
        smoothed = smoothed_demand(None, 0.0, demand, float(spec.smoothing_s))
    else:
        smoothed = smoothed_demand(entry.demand, now - entry.sampled_at, demand, float(spec.smoothing_s))
    decision, state = decide(adapter.agent_name, policy, entry.state, entry.desired, smoothed, now)
    return AdapterScaling(adapter.uid, state, decision.to_replicas, entry.granted, smoothed, now), Decided(scaled, decision, current)


async def scale_fleet(rt: Runtime, view: FleetView, registries: Mapping[str, Registry], adapters: Sequence[AdapterObject]) -> None:
    """Decide the replicas of the fleet's demand-scaled adapters (``adapters``: the fleet's
    live ones) from their agents' demand now, share the slots, and report each change."""
    scaled = [Scaled(a, a.spec.scaling) for a in adapters if a.spec.scaling is not None]
    book = rt.books.scaling.setdefault((view.namespace, view.name), {})
    for gone in set(book) - {s.name for s in scaled}:
        del book[gone]
        _forget_metrics(view.namespace, gone)
    if not scaled:
        return
    samples = await ask_each(view.dialable, lambda agent: rt.agents.adapter_stats(agent.endpoint, view.creds))
    now = time.monotonic()
    decided = []
    for one in scaled:
        demand = demand_of(one.name, one.spec.metric, samples, registries)
        book[one.name], outcome = decide_one(one, book.get(one.name), demand, holders(one.name, registries), now)
        decided.append(outcome)
    _share(view, registries, book, scaled)
    for outcome in decided:
        await _report(rt, outcome, book[outcome.scaled.name])


def _share(view: FleetView, registries: Mapping[str, Registry], book: dict[str, AdapterScaling], scaled: Sequence[Scaled]) -> None:
    """Each adapter's granted replicas: the slots of its base model shared by demand."""
    names = frozenset(s.name for s in scaled)
    for base_model in sorted({s.adapter.spec.base_model for s in scaled}):
        mine = [s for s in scaled if s.adapter.spec.base_model == base_model]
        claims = [
            SlotClaim(s.name, book[s.name].demand, book[s.name].desired, holders(s.name, registries), s.spec.min_replicas) for s in mine
        ]
        granted = share_slots(claims, slots_for(view, registries, base_model, names))
        for s in mine:
            entry = book[s.name]
            book[s.name] = AdapterScaling(entry.uid, entry.state, entry.desired, granted[s.name], entry.demand, entry.sampled_at)


def _forget_metrics(namespace: str, name: str) -> None:
    """A demand-scaled adapter left the fleet: its gauges go (the label set stays bounded)."""
    adapter = name.partition(".")[2]
    for gauge in (metrics.DESIRED_REPLICAS, metrics.CURRENT_REPLICAS):
        try:
            gauge.remove(namespace, adapter)
        except KeyError:
            continue


def scaling_status(one: Decided, entry: AdapterScaling, previous: Mapping[str, Any]) -> dict[str, Any]:
    """``status.scaling``: desired and current replicas, the demand behind them, and the last
    change of the desired replicas (kept from ``previous`` when this round changed nothing)."""
    spec = one.scaled.spec
    status: dict[str, Any] = {
        "desiredReplicas": entry.desired,
        "currentReplicas": one.current,
        "demand": "unknown" if one.decision is None else f"{entry.demand:.3g}",
        "metric": str(spec.metric),
    }
    decision = one.decision
    if decision is not None and decision.to_replicas != decision.from_replicas:
        status["lastDecision"] = {
            "time": now_rfc3339(),
            "from": decision.from_replicas,
            "to": decision.to_replicas,
            "reason": str(decision.reason),
            "message": decision.message[:1024],
        }
    elif "lastDecision" in previous:
        status["lastDecision"] = previous["lastDecision"]
    return status


async def _report(rt: Runtime, one: Decided, entry: AdapterScaling) -> None:
    """A change's Event and counter; the gauges; ``status.scaling`` when it changed."""
    adapter, decision = one.scaled.adapter, one.decision
    metrics.DESIRED_REPLICAS.labels(adapter.namespace, adapter.name).set(entry.desired)
    metrics.CURRENT_REPLICAS.labels(adapter.namespace, adapter.name).set(one.current)
    if decision is not None and decision.to_replicas != decision.from_replicas:
        up = decision.to_replicas > decision.from_replicas
        metrics.SCALING_DECISIONS.labels(direction="up" if up else "down").inc()
        reason = "ScaledUp" if up else "ScaledDown"
        post_event(adapter.ref, "Normal", reason, decision.message)
        log.info("scaling: %s/%s %s %s", adapter.namespace, adapter.name, reason, decision.message)
    previous = adapter.status.get("scaling") or {}
    status = scaling_status(one, entry, previous)
    if status == previous:
        return
    try:
        await rt.kube.patch_adapter_status(adapter.namespace, adapter.name, {"scaling": status})
    except ApiException as err:  # its own alone: the next check writes it again
        log.warning("scaling: status of %s/%s not written: %s %s", adapter.namespace, adapter.name, err.status, err.reason)
