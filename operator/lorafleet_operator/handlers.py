"""kopf handlers for LoraAdapter (create, update, resume, delete), LoraFleet (delete), agent
pods and EndpointSlices.

Each handler is a small function that takes the kopf kwargs it uses and hands the work to
the modules of reconciliation (:mod:`looks`, :mod:`loads`, :mod:`unloads`). A body is parsed
once here (:mod:`resources`); everything inward reads typed values. Retries are kopf's,
decided by :mod:`failures` (every adapter handler is wrapped in
:func:`~lorafleet_operator.failures.kopf_retries`): a transient failure is retried with an
exponential delay; a permanent one stops (no hot loop) after the status says Failed; a new
generation (``spec`` changed) runs the update handler again. The drift check
(:mod:`drift`) keeps everything consistent between those events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import kopf

from lorafleet_operator import metrics
from lorafleet_operator.admission import admission
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
from lorafleet_operator.fleet import pod_summary
from lorafleet_operator.loads import condemned, place_and_load, retry_due_in
from lorafleet_operator.looks import fleet_view, unload_view
from lorafleet_operator.publish import post_event, publish_status
from lorafleet_operator.reasons import EventReason, Reason
from lorafleet_operator.resources import AdapterObject, FleetObject, FleetSpec, ObjectRef, adapter_of, fleet_of
from lorafleet_operator.routing import publish_slices, remove_slices
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.slice_guard import guard_slice
from lorafleet_operator.status import AgentResult, Pending, Phase, build_status, initial_status, never_reconciled
from lorafleet_operator.unloads import UnloadOutcome, unload_from_holders, unload_message
from lorafleet_operator.view import FleetView

log = logging.getLogger("lorafleet.operator")


@kopf.index("", "v1", "pods")
def agent_pods(body: kopf.Body, namespace: str | None, **_: Any) -> dict[str, dict[str, Any]]:
    """kopf's index of the watched namespaces' pods (by namespace; :func:`pod_summary` of
    each): fleet views read their agents from it instead of listing pods at every
    reconcile. kopf fills it from the pod watch before any handler runs, and updates it
    before the pod event handler below pokes a drift check."""
    return {namespace or "": pod_summary(body)}


@kopf.index(GROUP, VERSION, FLEETS)
def lora_fleets(body: kopf.Body, namespace: str | None, name: str | None, **_: Any) -> dict[tuple[str, str], FleetObject]:
    """kopf's index of the watched namespaces' LoraFleets (by namespace and name; each
    parsed, its status dropped), fed by the fleet watch the operator keeps anyway (the
    drift daemons, the delete handler): a look at a fleet reads it from here instead of
    GETting it at every reconcile. kopf fills it before any handler runs and updates it
    before the handlers of the same event (a deletionTimestamp is in it before
    :func:`on_fleet_deleted` starts); a deleted fleet leaves it."""
    return {(namespace or "", name or ""): dataclasses.replace(fleet_of(body), status={})}


class SpecDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff base, built without deep-copying what it throws away.

    kopf builds an object's essence (spec, labels, annotations) at every watch event by
    deep-copying the whole body and then dropping ``status`` and the rest of ``metadata``
    (managed fields included): with an adapter's status written several times per load, that
    copy was a noticeable share of the operator's main-thread CPU at scale. The essence is the
    same: kopf's own build over the body without them."""

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
    _runtime(memo).watch.pods = pods
    _runtime(memo).watch.fleets = fleets
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


@dataclass(frozen=True)
class Reconciled:
    """What one reconcile of an adapter came to: its new status, the placed agents' results,
    why its generation is condemned ("" if it is not), and the look at its fleet (None when
    the fleet could not be used)."""

    status: dict[str, Any]
    results: list[AgentResult]
    crashed: str = ""
    view: FleetView | None = None


async def _reconcile(rt: Runtime, adapter: AdapterObject) -> Reconciled:
    """Look at the fleet, place the adapter and load it; the status that says how it went
    (Pending with the reason when the fleet cannot be used or does not admit it)."""
    try:
        view = await fleet_view(rt, adapter.namespace, adapter.spec.fleet)
        refused = admission(view.name, view.spec, adapter.spec)
        if refused is not None:
            raise refused
        placement, results = await place_and_load(rt, view, adapter)
    except FleetProblem as problem:
        pending = Pending(problem.reason, problem.message)
        return Reconciled(build_status([], generation=adapter.generation, previous=adapter.status, pending=pending), [])
    crashed = condemned(rt, adapter)
    status = build_status(results, generation=adapter.generation, previous=adapter.status, crashed=crashed, placement=placement)
    return Reconciled(status, results, crashed, view)


async def reconcile_adapter(rt: Runtime, body: kopf.Body, trigger: str) -> None:
    """Place the adapter, load it on every placed agent, write the status and the
    EndpointSlices; then let the policy say whether to retry
    (:func:`~lorafleet_operator.failures.check_load`)."""
    started = time.monotonic()
    adapter = adapter_of(body)
    new = never_reconciled(adapter.status)
    async with rt.locks.adapter(adapter.namespace, adapter.name):
        if new:
            first = initial_status(adapter.generation)
            await rt.kube.patch_adapter_status(adapter.namespace, adapter.name, first)
            adapter = adapter.with_status({**adapter.status, **first})
        done = await _reconcile(rt, adapter)
        await publish_status(rt, adapter, done.status)
        view = done.view
        await publish_slices(rt, adapter.ref, view.spec if view else FleetSpec(), view.agents if view else (), done.results, new=new)
        rt.books.reconciled[(adapter.namespace, adapter.name)] = time.monotonic()
    _log_reconciled(adapter, trigger, done.status, time.monotonic() - started)
    due_in = retry_due_in(rt, adapter, done.results)
    check_load(done.results, done.status["phase"], done.status["message"], condemned=bool(done.crashed), due_in=due_in)


def _log_reconciled(adapter: AdapterObject, trigger: str, status: dict[str, Any], elapsed: float) -> None:
    """The reconcile's metrics and its one log line."""
    metrics.RECONCILES.labels(trigger=trigger, phase=status["phase"]).inc()
    metrics.RECONCILE_SECONDS.labels(trigger=trigger).observe(elapsed)
    log.info(
        "reconciled loraadapter %s/%s gen=%s trigger=%s phase=%s agents=%s ranks=%s in %.2fs%s",
        adapter.namespace,
        adapter.name,
        adapter.generation,
        trigger,
        status["phase"],
        status["agentsSummary"],
        status["ranksSummary"],
        elapsed,
        f": {status['message']}" if status["message"] else "",
    )


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
    """Unload from every agent of the fleet that may hold the adapter (``unloads.may_hold``),
    then let kopf release the finalizer.

    Agents whose pod is gone or not Ready do not block. A Ready agent that cannot be reached
    is retried a few times; after that the finalizer is released anyway and the drift check
    unloads the orphan when the agent answers again (it is a managed name nobody wants).
    """
    started = time.monotonic()
    adapter = adapter_of(body)
    namespace, name = adapter.namespace, adapter.name
    async with rt.locks.adapter(namespace, name):
        status = build_status([], generation=adapter.generation, previous=adapter.status, deleting=True)
        await publish_status(rt, adapter, status)
        await _remove_slices(rt, adapter.ref)
        view, problem = await unload_view(rt, namespace, adapter.spec.fleet)
        if view is None:
            log.info("deleted loraadapter %s/%s: nothing to unload (%s)", namespace, name, problem)
            _forget_adapter(rt, adapter)
            return
        outcomes = await unload_from_holders(rt, view, adapter.agent_name)
    failures = [o.failure for o in outcomes if o.failure is not None]
    message = unload_message(outcomes)
    elapsed = time.monotonic() - started
    metrics.RECONCILES.labels(trigger="delete", phase=Phase.TERMINATING).inc()
    if delete_waits(rt.settings, retry, failures):
        log.info("unloading loraadapter %s/%s: %d/%d agents failed, retrying", namespace, name, len(failures), len(outcomes))
        raise Transient(message)
    if message:
        post_event(adapter.ref, "Warning", EventReason.UNLOAD_INCOMPLETE, message)
    _forget_adapter(rt, adapter)
    log.info(
        "deleted loraadapter %s/%s: unloaded from %d/%d agents that may hold it (of %d) in %.2fs",
        namespace,
        name,
        len(outcomes) - len(failures),
        len(outcomes),
        len(view.dialable),
        elapsed,
    )


async def _remove_slices(rt: Runtime, ref: ObjectRef) -> None:
    """Delete the adapter's EndpointSlices at once, so no gateway routes to it while it is
    unloaded. A failure does not hold the deletion: the slices' owner reference lets the
    garbage collector remove them."""
    try:
        await remove_slices(rt, ref.namespace, ref.name, ref.uid)
    except KUBE_API_ERRORS as err:
        log.warning(
            "endpointslices of loraadapter %s/%s not deleted: Kubernetes API: %s; left to the garbage collector",
            ref.namespace,
            ref.name,
            kube_reason(err),
        )


def _forget_adapter(rt: Runtime, adapter: AdapterObject) -> None:
    """Drop what this process kept about a deleted adapter (back-offs, crash book, the loads
    sent, its lock, its placement demand), and wake its fleet's drift check: the room it
    leaves goes to the oldest adapter waiting for it."""
    key, fleet = (adapter.namespace, adapter.name), (adapter.namespace, adapter.spec.fleet)
    rt.books.failures.clear_adapter(adapter.uid)
    rt.books.sent.forget(adapter.agent_name)
    rt.books.crashes.forget(adapter.uid)
    rt.locks.adapters.pop(key, None)
    rt.books.reconciled.pop(key, None)
    rt.caches.refused_status.pop(("LoraAdapter", *key), None)
    rt.books.demands.get(fleet, {}).pop(adapter.agent_name, None)
    poke = rt.watch.pokes.get(fleet)
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
    fleet = fleet_of(body)
    namespace, name = fleet.namespace, fleet.name
    async with rt.locks.fleet(namespace, name):
        adapters = [a for a in map(adapter_of, await rt.kube.list_adapters(namespace)) if a.spec.fleet == name]
        view, problem = await unload_view(rt, namespace, name)
        # Nowhere to unload (e.g. its Secret was never opened and no agent was seen): say why.
        unreachable = problem if view is None else ""
        outcomes = [o for part in await asyncio.gather(*(_release_adapter(rt, view, a, unreachable) for a in adapters)) for o in part]
    failures: list[AgentFailure] = [o.failure for o in outcomes if o.failure is not None]
    message = unload_message(outcomes)
    if delete_waits(rt.settings, retry, failures):
        log.info("deleting lorafleet %s/%s: %d unloads failed, retrying", namespace, name, len(failures))
        raise Transient(message)
    if message:
        post_event(fleet.ref, "Warning", EventReason.UNLOAD_INCOMPLETE, message)
    _forget_fleet(rt, fleet)
    log.info(
        "deleted lorafleet %s/%s: %d adapters unloaded from %d agents in %.2fs%s",
        namespace,
        name,
        len(adapters),
        len(view.dialable) if view else 0,
        time.monotonic() - started,
        f" ({unreachable})" if unreachable else "",
    )


def _forget_fleet(rt: Runtime, fleet: FleetObject) -> None:
    """Drop what this process kept about a deleted fleet."""
    key = (fleet.namespace, fleet.name)
    rt.watch.pokes.pop(key, None)
    rt.locks.fleets.pop(key, None)
    rt.caches.last_views.pop(key, None)
    rt.caches.fleet_agents.pop(key, None)
    rt.books.demands.pop(key, None)
    rt.caches.refused_status.pop(("LoraFleet", *key), None)


async def _release_adapter(rt: Runtime, view: FleetView | None, adapter: AdapterObject, unreachable: str) -> list[UnloadOutcome]:
    """Unload one adapter of a fleet being deleted from its agents; a live one becomes Pending
    (``FleetDeleted``). One being deleted itself keeps its own status (Terminating)."""
    async with rt.locks.adapter(adapter.namespace, adapter.name):
        outcomes = [] if view is None else await unload_from_holders(rt, view, adapter.agent_name)
        if not adapter.deleting:
            incomplete = unload_message(outcomes) or unreachable
            pending = f"LoraFleet {adapter.spec.fleet!r} was deleted: the adapter was unloaded from its agents" + (
                f" (not everywhere: {incomplete})" if incomplete else ""
            )
            status = build_status(
                [], generation=adapter.generation, previous=adapter.status, pending=Pending(Reason.FLEET_DELETED, pending)
            )
            await publish_status(rt, adapter, status)
            await publish_slices(rt, adapter.ref, view.spec if view else FleetSpec(), (), [])
    return outcomes


@kopf.on.event("discovery.k8s.io", "v1", "endpointslices")
async def on_endpoint_slice_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """An EndpointSlice changed in a watched namespace: the operator keeps its own as it wrote
    them, deletes impostors (:mod:`slice_guard`). Unfiltered: a tampered one may lack labels."""
    await guard_slice(_runtime(memo), type, body)


@kopf.on.event("", "v1", "pods")
def on_pod_event(type: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A pod appeared, changed readiness or restarted: check the namespace's fleets now rather
    than at the next interval (a new or newly ready agent gets its adapters at once)."""
    watch = _runtime(memo).watch
    meta, status = body.get("metadata", {}), body.get("status", {})
    key = (meta.get("namespace", ""), meta.get("name", ""))
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    restarts = sum(int(s.get("restartCount", 0)) for s in status.get("containerStatuses") or [])
    seen = (type != "DELETED", ready, status.get("podIP"), restarts)
    if watch.pods_seen.get(key) == seen:
        return
    watch.pods_seen[key] = seen
    for (namespace, _fleet), event in watch.pokes.items():
        if namespace == key[0]:
            event.set()
