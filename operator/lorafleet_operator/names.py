"""How a LoraAdapter is named inside an agent's registry, and which names this operator owns.

An agent's registry is shared with people who load adapters over gRPC directly, so the drift
check must only ever unload adapters the operator put there. The agent-side name is
``<namespace>.<name>``: Kubernetes namespaces are DNS labels (no dots), so the first dot splits
it back unambiguously, and an agent pod only ever receives adapters of its own namespace. A
registry name counts as managed when its prefix is the agent pod's namespace; names loaded by
hand without that prefix (e.g. ``support``) are never touched.
"""

from __future__ import annotations


def agent_name(namespace: str, name: str) -> str:
    """The adapter's name in every agent registry."""
    return f"{namespace}.{name}"


def is_managed(registry_name: str, namespace: str) -> bool:
    """Whether a registry entry on an agent pod in ``namespace`` belongs to this operator."""
    return registry_name.startswith(f"{namespace}.") and len(registry_name) > len(namespace) + 1

