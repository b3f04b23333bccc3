"""Adapters on standby (``spec.scaling.minReplicas: 0``, docs/scaling.md) as the drift check
sees them: which registry entries are wanted as they are (the agents load a standby adapter to
a slot on its first request, and put one back on standby to make room: neither is a stray nor
forced back), whether a standby adapter's first request can load it now (routing), and putting
an adapter back on standby where a scale-down left it resident.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.agent_values import AgentError, AgentInfo
from lorafleet_operator.resources import AdapterObject, AdapterSpec
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.status import AgentResult, AgentState
from lorafleet_operator.view import FleetView, Registry, Target

log = logging.getLogger("lorafleet.operator.drift")


def same_version(entry: RegistryEntry, spec: AdapterSpec) -> bool:
    """Whether a registry entry is this spec (source, sha256 when given, pinning)."""
    sha = spec.source.sha256
    return entry.source_uri == spec.source.uri and (not sha or entry.sha256 == sha) and entry.pinned == spec.pinned


def loadable(info: AgentInfo | None, registry: Mapping[str, RegistryEntry]) -> bool:
    """Whether a standby adapter's first request there can load it now: a free slot, or a
    resident adapter that is not pinned (the agent evicts the least recently used idle one)."""
    resident = [entry for entry in registry.values() if not entry.standby]
    return info is None or len(resident) < info.max_loaded_loras or any(not entry.pinned for entry in resident)


def as_held(target: Target, entry: RegistryEntry, adapter: AdapterObject, registry: Mapping[str, RegistryEntry]) -> AgentResult | None:
    """The result of an agent that holds this version of an adapter on standby where it is
    wanted as it is, None when a load is due. On standby where it is placed resident: kept,
    when it was placed there before (the agent put it back on standby: its LRU, not forced
    back); loaded when newly placed there. Resident where it is wanted on standby: kept, unless
    it was placed there before (a scale-down: put back on standby)."""
    pod, total = target.agent.name, target.ranks_total
    if not entry.standby:
        if len(entry.ranks) >= total and not (target.standby and pod in adapter.placed):
            return AgentResult(pod, AgentState.LOADED, min(len(entry.ranks), total), total)
        return None
    if target.standby or pod in adapter.placed:
        return AgentResult(pod, AgentState.STANDBY, 0, total, loadable=loadable(target.info, registry))
    return None


async def demote(
    rt: Runtime, view: FleetView, registries: Mapping[str, Registry], targets: Sequence[Target], adapter: AdapterObject
) -> None:
    """Unload the adapter where it is resident and wanted on standby (a scale-down), before
    its standby load: a standby load of a resident adapter leaves it resident."""
    name = adapter.agent_name
    resident = []
    for target in targets:
        registry = registries.get(target.agent.name)
        if isinstance(registry, Mapping) and name in registry and not registry[name].standby:
            resident.append(target)
    for target in resident:
        rt.books.reservations.finished(target.agent.endpoint, name, time.monotonic(), loaded=False)
    answers = await rt.agents.unload_each([(t.agent.endpoint, view.creds, name) for t in resident])
    for target, answer in zip(resident, answers, strict=True):
        if isinstance(answer, AgentError):
            log.warning("drift: putting %s back on standby on %s failed: %s", name, target.agent.name, answer)
        else:
            log.info("drift: %s put back on standby on %s (scaled down)", name, target.agent.name)
