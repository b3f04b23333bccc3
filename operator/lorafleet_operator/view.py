"""One look at a fleet, and the agents an adapter should be on: the values the handlers,
the drift check, loads and unloads pass each other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.agent_values import AgentError, AgentInfo, Credentials
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.resources import FleetSpec

#: One agent's registry (ListAdapters by name), or the error that stands for it.
Registry = Mapping[str, RegistryEntry] | AgentError


@dataclass(frozen=True)
class Target:
    """An agent an adapter should be on; ``info`` is None when Describe did not answer."""

    agent: AgentPod
    info: AgentInfo | None
    error: AgentError | None = None
    #: Load it on standby there (``spec.scaling.minReplicas: 0``): verified and kept on disk,
    #: loaded to a slot by its first request.
    standby: bool = False

    @property
    def ranks_total(self) -> int:
        return self.info.tp_size if self.info else 0


@dataclass(frozen=True)
class FleetView:
    """One look at a fleet: its agent pods, their Describe (or its error), the credentials."""

    namespace: str
    agents: tuple[AgentPod, ...]
    infos: Mapping[str, AgentInfo | AgentError]
    creds: Credentials
    #: The LoraFleet's name and spec, as looked at (its owner's policy:
    #: :func:`~lorafleet_operator.admission.admission`).
    name: str = ""
    spec: FleetSpec = field(default_factory=FleetSpec)

    @property
    def dialable(self) -> list[AgentPod]:
        return [a for a in self.agents if a.dialable]
