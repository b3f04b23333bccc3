"""Adapters on standby (``spec.scaling.minReplicas: 0``, docs/scaling.md) as the drift check
sees them: which registry entries are wanted as they are (the agents load a standby adapter to
a slot on its first request, and put one back on standby to make room: neither is a stray nor
forced back), and whether a standby adapter's first request can load it now (routing).

Where a scale-down leaves an adapter resident, its standby load (the drift check's repair, as
for any standby target) puts it back on standby in place: the agent keeps it routable
throughout (docs/agent.md, Standby), so the pod never answers 404 for it meanwhile.
"""

from __future__ import annotations

from collections.abc import Mapping

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.agent_values import AgentInfo
from lorafleet_operator.resources import AdapterObject, AdapterSpec
from lorafleet_operator.status import AgentResult, AgentState
from lorafleet_operator.view import Target


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
    it was placed there before (a scale-down: its standby load puts it back on standby)."""
    pod, total = target.agent.name, target.ranks_total
    if not entry.standby:
        if len(entry.ranks) >= total and not (target.standby and pod in adapter.placed):
            return AgentResult(pod, AgentState.LOADED, min(len(entry.ranks), total), total)
        return None
    if target.standby or pod in adapter.placed:
        return AgentResult(pod, AgentState.STANDBY, 0, total, loadable=loadable(target.info, registry))
    return None
