"""kopf handlers for LoraAdapter (create, update, resume, delete), LoraFleet (delete) and
agent pods.

Each handler is a small function that takes the kopf kwargs it uses and hands the work to
:mod:`reconcile`. Retries are kopf's, decided by :mod:`failures` (every adapter handler is
wrapped in :func:`~lorafleet_operator.failures.kopf_retries`): a transient failure is retried
with an exponential delay; a permanent one stops (no hot loop) after the status says Failed;
a new generation (``spec`` changed) runs the update handler again. The drift check
(:mod:`drift`) keeps everything consistent between those events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from lorafleet_operator import metrics, names
from lorafleet_operator.config import ADAPTERS, ANNOTATION_PREFIX, FINALIZER, FLEETS, GROUP, VERSION
from lorafleet_operator.failures import (
    KUBE_API_ERRORS,
    AgentFailure,
    FleetProblem,
    Transient,
    check_load,
    delete_waits,
    kopf_api_backoffs,
    kopf_retries,
    kube_reason,
)
from lorafleet_operator.fleet import fleet_summary, pod_summary
from lorafleet_operator.publish import post_event, publish_status
from lorafleet_operator.reconcile import (
    FLEET_DELETED,
    FleetView,
    UnloadOutcome,
    condemned,
    fleet_view,
    place_and_load,
    retry_due_in,
    unload_from_holders,
    unload_message,
    unload_view,
)
from lorafleet_operator.routing import publish_slices, remove_slices
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.status import Phase, build_status, initial_status, never_reconciled

log = logging.getLogger("lorafleet.operator")


@kopf.index("", "v1", "pods")
def agent_pods(body: kopf.Body, namespace: str | None, **_: Any) -> dict[str, dict[str, Any]]:
    """kopf's index of the watched namespaces' pods (by namespace; :func:`pod_summary` of
    each): fleet views read their agents from it instead of listing pods at every
    reconcile. kopf fills it from the pod watch before any handler runs, and updates it
    before the pod event handler below pokes a drift check."""
    return {namespace or "": pod_summary(body)}


@kopf.index(GROUP, VERSION, FLEETS)
def lora_fleets(body: kopf.Body, namespace: str | None, name: str | None, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """kopf's index of the watched namespaces' LoraFleets (by namespace and name;
    :func:`fleet_summary` of each), fed by the fleet watch the operator keeps anyway (the
    drift daemons, the delete handler): a look at a fleet reads it from here instead of
    GETting it at every reconcile. kopf fills it before any handler runs and updates it
    before the handlers of the same event (a deletionTimestamp is in it before
    :func:`on_fleet_deleted` starts); a deleted fleet leaves it."""
    return {(namespace or "", name or ""): fleet_summary(body)}


class SpecDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff base, built without deep-copying what it throws away.

    kopf builds an object's essence (spec, labels, annotations) at every watch event by
    deep-copying the whole body and then dropping ``status`` and the rest of ``metadata``
    (managed fields included): with an adapter's status written several times per load, that
    copy was about 7% of the operator's main-thread CPU at 300 adapters x 64 agents (py-spy,
    2026-12-01). The essence is the same: kopf's own build over the body without them."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None) -> kopf.BodyEssence:
        """The essence kopf compares (as its own build makes it). Extra fields under ``spec``
        are in it already (kopf passes ``spec`` itself, the field of the update handler, at
        every event); others (which may name status fields) take kopf's own path over the
        whole body."""
        outside_spec = [f for f in extra_fields or () if _field_path(f)[:1] != ("spec",)]
        if outside_spec or not set(body) <= {"apiVersion", "kind", "metadata", "spec", "status"}:
            return super().build(body=body, extra_fields=extra_fields)
        meta = body.get("metadata") or {}
        reduced = kopf.RawBody(metadata={})
        if "labels" in meta:
            reduced["metadata"]["labels"] = meta["labels"]
        if "annotations" in meta:
            reduced["metadata"]["annotations"] = meta["annotations"]
        if "spec" in body:
            reduced["spec"] = body["spec"]
        return super().build(body=kopf.Body(reduced))


def _field_path(field: kopf.FieldSpec) -> tuple[str, ...]:
    """A kopf field spec ("spec.x", its parts, or None: no field) as its path."""
    return tuple(field.split(".")) if isinstance(field, str) else tuple(field or ())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    """kopf settings: our own finalizer and annotation names, no cluster-wide scans (the
    chart's RBAC is namespaced), Events only when we post them, and the policy's endless
    back-off for kopf's own failed API requests (its default gives up after ~1 minute, and a
    watch that gives up stops the operator). The pod index and the fleet index (live, kopf
    keeps them current) go into the runtime."""
    # kopf hands every handler each index as a kwarg named after its function.
    pods: kopf.Index[str, Any] = kwargs["agent_pods"]
    fleets: kopf.Index[tuple[str, str], Any] = kwargs["lora_fleets"]
    _runtime(memo).pods = pods
    _runtime(memo).fleets = fleets
    settings.networking.error_backoffs = kopf_api_backoffs(_runtime(memo).settings)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = SpecDiffBase(prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.scanning.disabled = True
    settings.posting.loggers = False
    settings.posting.reporting_component = "lorafleet-operator"
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def _runtime(memo: kopf.Memo) -> Runtime:
    runtime: Runtime = memo["runtime"]  # put there by main.run
    return runtime


async def reconcile_adapter(rt: Runtime, body: kopf.Body, trigger: str) -> None:
    """Place the adapter, load it on every placed agent, write the status and the
    EndpointSlices; then let the policy say whether to retry
    (:func:`~lorafleet_operator.failures.check_load`)."""
    started = time.monotonic()
    meta, spec = body["metadata"], body["spec"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 0)
    previous = dict(body.get("status") or {})
    new = never_reconciled(previous)
    async with rt.lock(namespace, name):
        if new:
            first = initial_status(generation)
            await rt.kube.patch_adapter_status(namespace, name, first)
            previous = {**previous, **first}
        try:
            view = await fleet_view(rt, namespace, spec["fleetRef"]["name"])
            view.admit(spec)
            placement, results = await place_and_load(rt, view, {**body, "status": previous})
            crashed = condemned(rt, {**body, "status": previous})
            status = build_status(results, generation=generation, previous=previous, crashed=crashed, placement=placement)
        except FleetProblem as problem:
            crashed, results, view = "", [], None
            status = build_status(
                [], generation=generation, previous=previous, pending_reason=problem.reason, pending_message=problem.message
            )
        await publish_status(rt, {**body, "status": previous}, status)
        await publish_slices(rt, body, view.spec if view else {}, view.agents if view else (), results, new=new)
        rt.reconciled[(namespace, name)] = time.monotonic()
    elapsed = time.monotonic() - started
    metrics.RECONCILES.labels(trigger=trigger, phase=status["phase"]).inc()
    metrics.RECONCILE_SECONDS.labels(trigger=trigger).observe(elapsed)
    log.info(
        "reconciled loraadapter %s/%s gen=%s trigger=%s phase=%s agents=%s ranks=%s in %.2fs%s",
        namespace,
        name,
        generation,
        trigger,
        status["phase"],
        status["agentsSummary"],
        status["ranksSummary"],
        elapsed,
        f": {status['message']}" if status["message"] else "",
    )
    check_load(results, status["phase"], status["message"], condemned=bool(crashed), due_in=retry_due_in(rt, body, results))


@kopf.on.create(GROUP, VERSION, ADAPTERS)
@kopf_retries
async def on_adapter_created(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await reconcile_adapter(_runtime(memo), body, "create")


@kopf.on.update(GROUP, VERSION, ADAPTERS, field="spec")
@kopf_retries
async def on_adapter_updated(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await reconcile_adapter(_runtime(memo), body, "update")


@kopf.on.resume(GROUP, VERSION, ADAPTERS)
@kopf_retries
async def on_adapter_resumed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """After an operator (re)start: the same reconcile; loads are idempotent."""
    await reconcile_adapter(_runtime(memo), body, "resume")


@kopf.on.delete(GROUP, VERSION, ADAPTERS)
@kopf_retries
async def on_adapter_deleted(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    await unload_adapter(_runtime(memo), body, retry)


async def unload_adapter(rt: Runtime, body: kopf.Body, retry: int) -> None:
    """Unload from every agent of the fleet that may hold the adapter (``reconcile.may_hold``),
    then let kopf release the finalizer.

    Agents whose pod is gone or not Ready do not block. A Ready agent that cannot be reached
    is retried a few times; after that the finalizer is released anyway and the drift check
    unloads the orphan when the agent answers again (it is a managed name nobody wants).
    """
    started = time.monotonic()
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    async with rt.lock(namespace, name):
        status = build_status([], generation=meta.get("generation", 0), previous=body.get("status"), deleting=True)
        await publish_status(rt, body, status)
        await _remove_slices(rt, meta)
        view, problem = await unload_view(rt, namespace, body["spec"]["fleetRef"]["name"])
        if view is None:
            log.info("deleted loraadapter %s/%s: nothing to unload (%s)", namespace, name, problem)
            _forget_adapter(rt, meta, body["spec"]["fleetRef"]["name"])
            return
        outcomes = await unload_from_holders(rt, view, names.agent_name(namespace, name))
    failures = [o.failure for o in outcomes if o.failure is not None]
    message = unload_message(outcomes)
    elapsed = time.monotonic() - started
    metrics.RECONCILES.labels(trigger="delete", phase=Phase.TERMINATING).inc()
    if delete_waits(rt.settings, retry, failures):
        log.info("unloading loraadapter %s/%s: %d/%d agents failed, retrying", namespace, name, len(failures), len(outcomes))
        raise Transient(message)
    if message:
        post_event(body, "Warning", "UnloadIncomplete", message)
    _forget_adapter(rt, meta, body["spec"]["fleetRef"]["name"])
    log.info(
        "deleted loraadapter %s/%s: unloaded from %d/%d agents that may hold it (of %d) in %.2fs",
        namespace,
        name,
        len(outcomes) - len(failures),
        len(outcomes),
        len(view.dialable),
        elapsed,
    )


async def _remove_slices(rt: Runtime, meta: Mapping[str, Any]) -> None:
    """Delete the adapter's EndpointSlices at once, so no gateway routes to it while it is
    unloaded. A failure does not hold the deletion: the slices' owner reference lets the
    garbage collector remove them."""
    try:
        await remove_slices(rt, meta["namespace"], meta["name"], meta.get("uid", ""))
    except KUBE_API_ERRORS as err:
        log.warning(
            "endpointslices of loraadapter %s/%s not deleted: Kubernetes API: %s; left to the garbage collector",
            meta["namespace"],
            meta["name"],
            kube_reason(err),
        )


def _forget_adapter(rt: Runtime, meta: Mapping[str, Any], fleet: str) -> None:
    """Drop what this process kept about a deleted adapter (back-offs, crash book, the loads
    sent, its lock, its placement demand), and wake its fleet's drift check: the room it
    leaves goes to the oldest adapter waiting for it."""
    rt.failures.clear_adapter(meta.get("uid", ""))
    rt.sent.forget(names.agent_name(meta["namespace"], meta["name"]))
    rt.crashes.forget(meta.get("uid", ""))
    rt.locks.pop((meta["namespace"], meta["name"]), None)
    rt.reconciled.pop((meta["namespace"], meta["name"]), None)
    rt.refused_status.pop(("LoraAdapter", meta["namespace"], meta["name"]), None)
    rt.demands.get((meta["namespace"], fleet), {}).pop(names.agent_name(meta["namespace"], meta["name"]), None)
    poke = rt.pokes.get((meta["namespace"], fleet))
    if poke is not None:
        poke.set()


@kopf.on.delete(GROUP, VERSION, FLEETS)
@kopf_retries
async def on_fleet_deleted(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    await release_fleet(_runtime(memo), body, retry)


async def release_fleet(rt: Runtime, body: kopf.Body, retry: int) -> None:
    """A LoraFleet is being deleted: its finalizer (``lorafleet.dev/unload``) holds it until
    every adapter that references it is unloaded from its agents, and each live one is Pending
    with reason ``FleetDeleted``. The fleet object still exists meanwhile (deletionTimestamp
    set), so its selector and Secrets still say where and how to unload; nothing has to
    remember it afterwards. Loads stop at once: a look at a fleet being deleted refuses
    (``FleetDeleted``), and the fleet's drift check never runs beside this (the fleet lock).
    An unreachable Ready agent is retried like an adapter's deletion (``delete_waits``), then
    the fleet is released with a Warning Event ``UnloadIncomplete``."""
    started = time.monotonic()
    meta = body["metadata"]
    namespace, fleet = meta["namespace"], meta["name"]
    async with rt.fleet_lock(namespace, fleet):
        adapters = [a for a in await rt.kube.list_adapters(namespace) if a["spec"]["fleetRef"]["name"] == fleet]
        view, problem = await unload_view(rt, namespace, fleet)
        # Nowhere to unload (e.g. its Secret was never opened and no agent was seen): say why.
        unreachable = problem if view is None else ""
        outcomes = [
            o for part in await asyncio.gather(*(_release_adapter(rt, view, fleet, a, unreachable) for a in adapters)) for o in part
        ]
    failures: list[AgentFailure] = [o.failure for o in outcomes if o.failure is not None]
    message = unload_message(outcomes)
    if delete_waits(rt.settings, retry, failures):
        log.info("deleting lorafleet %s/%s: %d unloads failed, retrying", namespace, fleet, len(failures))
        raise Transient(message)
    if message:
        post_event(body, "Warning", "UnloadIncomplete", message)
    rt.pokes.pop((namespace, fleet), None)
    rt.fleet_locks.pop((namespace, fleet), None)
    rt.last_views.pop((namespace, fleet), None)
    rt.fleet_agents.pop((namespace, fleet), None)
    rt.demands.pop((namespace, fleet), None)
    rt.refused_status.pop(("LoraFleet", namespace, fleet), None)
    log.info(
        "deleted lorafleet %s/%s: %d adapters unloaded from %d agents in %.2fs%s",
        namespace,
        fleet,
        len(adapters),
        len(view.dialable) if view else 0,
        time.monotonic() - started,
        f" ({unreachable})" if unreachable else "",
    )


async def _release_adapter(
    rt: Runtime, view: FleetView | None, fleet: str, adapter: Mapping[str, Any], unreachable: str
) -> list[UnloadOutcome]:
    """Unload one adapter of a fleet being deleted from its agents; a live one becomes Pending
    (``FleetDeleted``). One being deleted itself keeps its own status (Terminating)."""
    meta = adapter["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    async with rt.lock(namespace, name):
        outcomes = [] if view is None else await unload_from_holders(rt, view, names.agent_name(namespace, name))
        if not meta.get("deletionTimestamp"):
            incomplete = unload_message(outcomes) or unreachable
            pending = f"LoraFleet {fleet!r} was deleted: the adapter was unloaded from its agents" + (
                f" (not everywhere: {incomplete})" if incomplete else ""
            )
            status = build_status(
                [],
                generation=int(meta.get("generation", 0)),
                previous=adapter.get("status"),
                pending_reason=FLEET_DELETED,
                pending_message=pending,
            )
            await publish_status(rt, adapter, status)
            await publish_slices(rt, adapter, view.spec if view else {}, (), [])
    return outcomes


@kopf.on.event("", "v1", "pods")
def on_pod_event(type: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A pod appeared, changed readiness or restarted: check the namespace's fleets now rather
    than at the next interval (a new or newly ready agent gets its adapters at once)."""
    rt = _runtime(memo)
    meta, status = body.get("metadata", {}), body.get("status", {})
    key = (meta.get("namespace", ""), meta.get("name", ""))
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    restarts = sum(int(s.get("restartCount", 0)) for s in status.get("containerStatuses") or [])
    seen = (type != "DELETED", ready, status.get("podIP"), restarts)
    if rt.pods_seen.get(key) == seen:
        return
    rt.pods_seen[key] = seen
    for (namespace, _fleet), event in rt.pokes.items():
        if namespace == key[0]:
            event.set()
