"""kopf handlers for LoraAdapter (create, update, resume, delete) and agent pods.

Each handler is a small function that takes the kopf kwargs it uses and hands the work to
:mod:`reconcile`. Retries are kopf's: a transient agent error raises ``kopf.TemporaryError``
with an exponential delay; a permanent one raises ``kopf.PermanentError`` (no hot loop) after
the status says Failed; a new generation (``spec`` changed) runs the update handler again.
The drift check (:mod:`drift`) keeps everything consistent between those events.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import kopf
import urllib3
from kubernetes.client.exceptions import ApiException

from lorafleet_operator import metrics, names
from lorafleet_operator.config import ADAPTERS, ANNOTATION_PREFIX, FINALIZER, GROUP, VERSION
from lorafleet_operator.publish import publish_status
from lorafleet_operator.reconcile import FleetProblem, fleet_view, load_everywhere, unload_everywhere
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.status import AgentState, Phase, build_status, initial_status

log = logging.getLogger("lorafleet.operator")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """kopf settings: our own finalizer and annotation names, no cluster-wide scans (the
    chart's RBAC is namespaced), Events only when we post them."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.scanning.disabled = True
    settings.posting.loggers = False
    settings.posting.reporting_component = "lorafleet-operator"
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def _runtime(memo: kopf.Memo) -> Runtime:
    return memo["runtime"]  # type: ignore[no-any-return]


async def reconcile_adapter(rt: Runtime, body: kopf.Body, trigger: str, retry: int) -> None:
    """Load the adapter on every target agent and write the status; raise kopf's retry errors."""
    started = time.monotonic()
    meta, spec = body["metadata"], body["spec"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 0)
    previous = dict(body.get("status") or {})
    async with rt.lock(namespace, name):
        if not previous.get("conditions"):
            await rt.kube.patch_adapter_status(namespace, name, initial_status(generation))
            previous = {**previous, **initial_status(generation)}
        try:
            view = await fleet_view(rt, namespace, spec["fleetRef"]["name"])
            results = await load_everywhere(rt, view, body)
            status = build_status(results, generation=generation, previous=previous)
        except FleetProblem as problem:
            results = []
            status = build_status([], generation=generation, previous=previous,
                                  pending_reason=problem.reason, pending_message=problem.message)
        await publish_status(rt, {**body, "status": previous}, status)
    elapsed = time.monotonic() - started
    metrics.RECONCILES.labels(trigger=trigger, phase=status["phase"]).inc()
    metrics.RECONCILE_SECONDS.labels(trigger=trigger).observe(elapsed)
    log.info("reconciled loraadapter %s/%s gen=%s trigger=%s phase=%s agents=%s ranks=%s "
             "in %.2fs%s", namespace, name, generation, trigger, status["phase"],
             status["agentsSummary"], status["ranksSummary"], elapsed,
             f": {status['message']}" if status["message"] else "")
    if any(r.state is AgentState.UNREACHABLE for r in results):
        raise kopf.TemporaryError(status["message"], delay=rt.settings.transient_delay(retry))
    if status["phase"] == Phase.FAILED:
        raise kopf.PermanentError(status["message"])


@contextlib.asynccontextmanager
async def api_errors_are_transient(rt: Runtime, retry: int) -> AsyncIterator[None]:
    """An API server that is restarting or overloaded is retried like an unreachable agent
    (kopf's default for unexpected errors would wait a whole minute)."""
    try:
        yield
    except (ApiException, urllib3.exceptions.HTTPError) as err:
        reason = f"{err.status} {err.reason}" if isinstance(err, ApiException) else repr(err)
        raise kopf.TemporaryError(f"Kubernetes API: {reason}",
                                  delay=rt.settings.transient_delay(retry)) from err


@kopf.on.create(GROUP, VERSION, ADAPTERS)
async def on_adapter_created(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    async with api_errors_are_transient(_runtime(memo), retry):
        await reconcile_adapter(_runtime(memo), body, "create", retry)


@kopf.on.update(GROUP, VERSION, ADAPTERS, field="spec")
async def on_adapter_updated(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    async with api_errors_are_transient(_runtime(memo), retry):
        await reconcile_adapter(_runtime(memo), body, "update", retry)


@kopf.on.resume(GROUP, VERSION, ADAPTERS)
async def on_adapter_resumed(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    """After an operator (re)start: the same reconcile; loads are idempotent."""
    async with api_errors_are_transient(_runtime(memo), retry):
        await reconcile_adapter(_runtime(memo), body, "resume", retry)


@kopf.on.delete(GROUP, VERSION, ADAPTERS)
async def on_adapter_deleted(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    async with api_errors_are_transient(_runtime(memo), retry):
        await unload_adapter(_runtime(memo), body, retry)


async def unload_adapter(rt: Runtime, body: kopf.Body, retry: int) -> None:
    """Unload from every agent of the fleet, then let kopf release the finalizer.

    Agents whose pod is gone or not Ready do not block. A Ready agent that cannot be reached
    is retried a few times; after that the finalizer is released anyway and the drift check
    unloads the orphan when the agent answers again (it is a managed name nobody wants).
    """
    started = time.monotonic()
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    async with rt.lock(namespace, name):
        status = build_status([], generation=meta.get("generation", 0),
                              previous=body.get("status"), deleting=True)
        await publish_status(rt, body, status)
        try:
            view = await fleet_view(rt, namespace, body["spec"]["fleetRef"]["name"])
            outcomes = await unload_everywhere(rt, view, names.agent_name(namespace, name))
        except FleetProblem as problem:
            log.info("deleted loraadapter %s/%s: nothing to unload (%s)", namespace, name,
                     problem.message)
            return
    failed = [o for o in outcomes if o.error is not None]
    elapsed = time.monotonic() - started
    metrics.RECONCILES.labels(trigger="delete", phase=Phase.TERMINATING).inc()
    if any(o.error.transient for o in failed) and retry < rt.settings.delete_retries:  # type: ignore[union-attr]
        log.info("unloading loraadapter %s/%s: %d/%d agents failed, retrying",
                 namespace, name, len(failed), len(outcomes))
        raise kopf.TemporaryError("; ".join(f"{o.pod}: {o.error}" for o in failed),
                                  delay=rt.settings.transient_delay(retry))
    if failed:
        kopf.warn(body, reason="UnloadIncomplete",
                  message="; ".join(f"{o.pod}: {o.error}" for o in failed)[:1024])
    for key in [k for k in rt.failures if k[0] == meta.get("uid")]:
        del rt.failures[key]
    rt.locks.pop((namespace, name), None)
    log.info("deleted loraadapter %s/%s: unloaded from %d/%d agents in %.2fs", namespace, name,
             len(outcomes) - len(failed), len(outcomes), elapsed)


@kopf.on.event("", "v1", "pods")
def on_pod_event(type: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A pod appeared, changed readiness or restarted: check the namespace's fleets now rather
    than at the next interval (a new or newly ready agent gets its adapters at once)."""
    rt = _runtime(memo)
    meta, status = body.get("metadata", {}), body.get("status", {})
    key = (meta.get("namespace", ""), meta.get("name", ""))
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    restarts = sum(int(s.get("restartCount", 0)) for s in status.get("containerStatuses") or [])
    seen = (type != "DELETED", ready, status.get("podIP"), restarts)
    if rt.pods_seen.get(key) == seen:
        return
    rt.pods_seen[key] = seen
    for (namespace, _fleet), event in rt.pokes.items():
        if namespace == key[0]:
            event.set()
