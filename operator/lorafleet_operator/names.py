"""How a LoraAdapter is named inside an agent's registry, and which names this operator owns.

An agent's registry is shared with people who load adapters over gRPC directly, so the drift
check must only ever unload adapters the operator put there. The agent-side name is
``<namespace>.<name>``: Kubernetes namespaces are DNS labels (no dots), so the first dot splits
it back unambiguously, and an agent pod only ever receives adapters of its own namespace. A
registry name counts as managed when its prefix is the agent pod's namespace; names loaded by
hand without that prefix (e.g. ``support``) are never touched.
"""

from __future__ import annotations

from lorafleet_common.adapter_names import MAX_NAME_LENGTH

#: Between the namespace and the name in a registry name.
SEPARATOR = "."
#: The longest registry name an agent holds: the shared rule (``lorafleet_common.adapter_names``).
MAX_AGENT_NAME = MAX_NAME_LENGTH
#: The longest namespace Kubernetes allows (a DNS label).
MAX_NAMESPACE = 63
#: The longest LoraAdapter name whose registry name fits every namespace: 253 - 63 - 1 = 189.
#: The LoraAdapter CRD refuses longer names (a CEL rule on ``metadata.name``; the API server
#: gives CEL no access to the namespace, so the bound assumes the longest one).
MAX_ADAPTER_NAME = MAX_AGENT_NAME - MAX_NAMESPACE - len(SEPARATOR)


def agent_name(namespace: str, name: str) -> str:
    """The adapter's name in every agent registry."""
    return f"{namespace}{SEPARATOR}{name}"


def is_managed(registry_name: str, namespace: str) -> bool:
    """Whether a registry entry on an agent pod in ``namespace`` belongs to this operator."""
    return registry_name.startswith(f"{namespace}.") and len(registry_name) > len(namespace) + 1
