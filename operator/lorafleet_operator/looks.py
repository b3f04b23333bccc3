"""A look at a fleet (:class:`~lorafleet_operator.view.FleetView`): the LoraFleet from kopf's
index, its agents from the pod index, its credentials from Secrets opened to it, and what
each agent is (Describe); and where a deletion unloads when the fleet can no longer be
looked at."""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

from lorafleet_operator.failures import FleetProblem
from lorafleet_operator.fanout import describe_all
from lorafleet_operator.fleet_secrets import fleet_credentials
from lorafleet_operator.identity import report_impostors
from lorafleet_operator.reasons import Reason
from lorafleet_operator.resources import FleetObject, fleet_of
from lorafleet_operator.runtime import Runtime, fleet_agents
from lorafleet_operator.view import FleetView


async def look_up_fleet(rt: Runtime, namespace: str, name: str) -> FleetObject | None:
    """The LoraFleet as kopf's fleet index has it (``handlers.lora_fleets``: current with the
    watch, no request); None when the API server does not have it either. A fleet the index
    lacks is asked for: one created a moment ago whose watch event has not arrived yet is
    found, and a missing one is confirmed missing (as when every reconcile read it)."""
    indexed = next(iter(rt.watch.fleets.get((namespace, name), ())), None)
    if indexed is not None:
        return indexed
    body = await rt.kube.get_fleet(namespace, name)
    return fleet_of(body) if body is not None else None


async def fleet_view(rt: Runtime, namespace: str, fleet_name: str, *, fresh: bool = False, terminating_ok: bool = False) -> FleetView:
    """Look at a fleet now. Raises FleetProblem when it is missing or unusable, or being deleted
    (unless ``terminating_ok``: unloads still reach the agents of a fleet being deleted)."""
    fleet = await look_up_fleet(rt, namespace, fleet_name)
    if fleet is None:
        raise FleetProblem(Reason.FLEET_NOT_FOUND, f"LoraFleet {fleet_name!r} not found in {namespace}")
    if fleet.deleting and not terminating_ok:
        raise FleetProblem(Reason.FLEET_DELETED, f"LoraFleet {fleet_name!r} is being deleted: its adapters are unloaded from its agents")
    agents = fleet_agents(rt, namespace, fleet_name, fleet.spec)
    rt.books.crashes.observe(agents)  # a restart since a load that ended unanswered is a crash
    creds = await fleet_credentials(rt.kube, namespace, fleet_name, fleet.spec)
    infos = await describe_all(rt, agents, creds, fresh=fresh)
    await report_impostors(rt.kube, rt.agents.identities, agents, infos)
    view = FleetView(namespace, agents, infos, creds, fleet_name, fleet.spec)
    if view.dialable:
        rt.caches.last_views[(namespace, fleet_name)] = view
    return view


async def unload_view(rt: Runtime, namespace: str, fleet_name: str) -> tuple[FleetView | None, str]:
    """Where a deletion unloads: the fleet as it is now, or — when that says nothing (the
    fleet unusable or gone, its pods gone, or the operator's namespaced rights gone while the
    namespace terminates: 403) — the last view of it that had agents (their endpoints and the
    credentials then). Namespace deletion removes pods, Secrets and RoleBindings before the
    operator's finalizers run; the agent processes behind those pods may serve other
    namespaces and still hold the adapters. Returns the view (None: nowhere known) and why
    the current look failed ("" when it did not)."""
    try:
        view: FleetView | None = await fleet_view(rt, namespace, fleet_name, terminating_ok=True)
        problem = ""
    except FleetProblem as err:
        view, problem = None, err.message
    except ApiException as err:
        if err.status not in (403, 404):
            raise
        view, problem = None, f"Kubernetes API: {err.status} {err.reason}"
    if view is not None and view.agents:
        return view, problem
    return rt.caches.last_views.get((namespace, fleet_name), view), problem
