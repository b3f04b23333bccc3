"""Agents that require a bearer token (``--auth-token-file``): the token, what the tests ask such
an agent with it, and the fleet that holds it in a Secret opened to the fleet."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.v1 import agent_pb2
from lorafleet_dev.agents import AgentProcess
from tests.kube.harness import ControlPlane
from tests.operator.agents import apply, fleet_manifest, stub
from tests.operator.test_tenants import secret

#: The label that opens a Secret to the fleet.
OPENED = {"lorafleet.dev/allow-fleet": "true"}


def write_token(root: Path) -> tuple[str, Path]:
    """A fresh agent token and the file under `root` that holds it (for ``--auth-token-file``)."""
    token = secrets.token_urlsafe(24)
    path = root / "token"
    path.write_text(token)
    return token, path


@dataclass(frozen=True)
class TokenAgent:
    """An agent process that requires `token`, asked with it."""

    process: AgentProcess
    token: str

    def _bearer(self) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.token}"),)

    def held(self, ns: str) -> set[str]:
        """This namespace's names in the agent's registry."""
        channel, agent_stub = stub(self.process)
        with channel:
            reply = agent_stub.ListAdapters(agent_pb2.ListAdaptersRequest(), metadata=self._bearer(), timeout=10)
        return {a.name for a in reply.adapters if a.name.startswith(f"{ns}.")}

    def unload(self, name: str) -> None:
        """Unload behind the operator's back (its drift check loads the adapter again)."""
        channel, agent_stub = stub(self.process)
        with channel:
            reply = agent_stub.UnloadAdapter(agent_pb2.UnloadAdapterRequest(name=name), metadata=self._bearer(), timeout=30)
        assert reply.success, reply.error_message


def token_fleet(cluster: ControlPlane, ns: str, token: str, allow: list[str], *objects: dict[str, Any]) -> None:
    """The default fleet with the agent's token (Secret ``agent-token``, opened to it) and these
    source prefixes, applied with `objects` (the fleet's other Secrets)."""
    fleet = fleet_manifest()
    fleet["spec"]["auth"] = {"tokenSecretRef": {"name": "agent-token"}}
    fleet["spec"]["sources"] = {"allow": allow}
    apply(cluster, ns, secret("agent-token", {"token": token.encode()}, OPENED), *objects, fleet)
