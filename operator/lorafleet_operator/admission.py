"""Whether a fleet's owner lets an adapter onto the fleet's agents (docs/operator.md,
"Security"): pinning and remote sources are privileges the fleet grants."""

from __future__ import annotations

from lorafleet_operator import sources
from lorafleet_operator.failures import FleetProblem
from lorafleet_operator.reasons import Reason
from lorafleet_operator.resources import AdapterSpec, FleetSpec


def admission(fleet_name: str, fleet: FleetSpec, adapter: AdapterSpec) -> FleetProblem | None:
    """The fleet's refusal of this adapter (None: admitted), checked before any load: a
    pinned adapter only where ``spec.pinning.allowed`` is true (pinning is a privilege the
    fleet grants, not every adapter creator's right), an http(s) or hf:// source only under
    one of ``spec.sources.allow`` (:mod:`~lorafleet_operator.sources`; none by default:
    remote sources are off until the owner names prefixes; the agents' --allow-source stays
    the second line)."""
    if adapter.pinned and not fleet.pinning_allowed:
        return FleetProblem(
            Reason.PINNING_NOT_ALLOWED,
            f"LoraFleet {fleet_name!r} does not allow pinned adapters (its owner sets spec.pinning.allowed: true); not loaded",
        )
    allowed = list(fleet.source_prefixes)
    why = sources.why_refused(adapter.source.uri, allowed)
    if why:
        return FleetProblem(
            Reason.SOURCE_NOT_ALLOWED,
            f"LoraFleet {fleet_name!r} does not allow this source: {why} ({len(allowed)} prefix(es) set by its owner); not loaded",
        )
    return None
