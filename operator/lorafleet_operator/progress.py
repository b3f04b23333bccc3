"""A long load's progress in the adapter's Ready condition.

While a handler's loads of a remote source (http(s), hf://) run, a side task asks each target
agent every :data:`INTERVAL_S` which downloads it is running (``ListAdapters.downloading``: the
agent answers from memory, without waiting on the load) and writes the bytes per agent into the
Ready condition's message, e.g. "Loading: downloading the source: agent-0 1.5 of 4.4 MiB,
agent-1 0.8 of 4.4 MiB". The loads themselves never wait on it. When they end, a message it
displaced is put back, so the handler's own status write (which compares with the status from
before the loads) decides what the condition says afterwards.

Each report replaces only the Ready condition's message, in a JSON patch guarded by the message
it read just before: a status another writer made meanwhile (a drift check correcting the
adapter's claims while this handler's loads run, ``claims``) is built on, never written over
with an older copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from lorafleet_operator import sources
from lorafleet_operator.agent_values import AgentError
from lorafleet_operator.kube import ConditionMessage
from lorafleet_operator.resources import AdapterObject
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.view import FleetView, Target

log = logging.getLogger(__name__)

#: Seconds between two looks at the agents' downloads (the first look is this long after the
#: loads start: a quick load shows nothing).
INTERVAL_S = 2.0
_MIB = 1 << 20


def describe(done: int, total: int) -> str:
    """One agent's bytes, "1.5 of 4.4 MiB" ("1.5 MiB" while the size is unknown)."""
    if total:
        return f"{done / _MIB:.1f} of {total / _MIB:.1f} MiB"
    return f"{done / _MIB:.1f} MiB"


def progress_message(per_agent: Mapping[str, tuple[int, int]]) -> str:
    """The Ready condition's message while agents download (pod -> (bytes done, declared))."""
    parts = ", ".join(f"{pod} {describe(*bytes_)}" for pod, bytes_ in sorted(per_agent.items()))
    return f"Loading: downloading the source: {parts}"


def ready_message_at(adapter: Mapping[str, Any] | None) -> ConditionMessage | None:
    """Where the Ready condition is in a stored adapter's status, with its message."""
    conditions = ((adapter or {}).get("status") or {}).get("conditions") or []
    for index, condition in enumerate(conditions):
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return ConditionMessage(index, "Ready", str(condition.get("message", "")))
    return None


@dataclass
class _Shown:
    """What the progress reports have written: the last message, and the message it displaced
    (the one to put back at the end)."""

    last: str = ""
    displaced: str = ""


async def _show(rt: Runtime, adapter: AdapterObject, message: str, shown: _Shown) -> None:
    """Write ``message`` into the Ready condition as stored now; a message another writer put
    there since the last report is the one to put back at the end. Best effort: a failure is
    logged, and a report racing another writer is skipped (the guard refuses it)."""
    try:
        at = ready_message_at(await rt.kube.get_adapter(adapter.namespace, adapter.name))
        if at is None:
            return
        if await rt.kube.replace_condition_message(adapter.namespace, adapter.name, at, message):
            if at.message != shown.last:
                shown.displaced = at.message
            shown.last = message
    except (ApiException, urllib3.exceptions.HTTPError) as err:
        log.warning("could not write the load progress of %s/%s: %s", adapter.namespace, adapter.name, err)


async def _put_back(rt: Runtime, adapter: AdapterObject, shown: _Shown) -> None:
    """Put the displaced message back, unless another writer changed the message since."""
    try:
        at = ready_message_at(await rt.kube.get_adapter(adapter.namespace, adapter.name))
        if at is not None and at.message == shown.last:
            await rt.kube.replace_condition_message(adapter.namespace, adapter.name, at, shown.displaced)
    except (ApiException, urllib3.exceptions.HTTPError) as err:
        log.warning("could not clear the load progress of %s/%s: %s", adapter.namespace, adapter.name, err)


async def _report(rt: Runtime, view: FleetView, targets: Sequence[Target], adapter: AdapterObject, shown: _Shown) -> None:
    """Every INTERVAL_S, the targets' downloads of this adapter into its Ready message."""
    name = adapter.agent_name
    while True:
        await asyncio.sleep(INTERVAL_S)
        per_agent: dict[str, tuple[int, int]] = {}
        for target in targets:
            try:
                running = await rt.agents.downloads(target.agent.endpoint, view.creds)
            except AgentError:
                continue  # the load's own result says what is wrong with that agent
            if name in running:
                per_agent[target.agent.name] = running[name]
        message = progress_message(per_agent) if per_agent else ""
        if message and message != shown.last:
            await _show(rt, adapter, message, shown)


@contextlib.asynccontextmanager
async def reporting(rt: Runtime, view: FleetView, targets: Sequence[Target], adapter: AdapterObject) -> AsyncIterator[None]:
    """Report the loads' download progress while the block runs (remote sources only); then put
    back the message a progress report displaced, if the last one is still there."""
    if not targets or not adapter.status.get("conditions") or not sources.is_remote(adapter.spec.source.uri):
        yield
        return
    shown = _Shown()
    task = asyncio.create_task(_report(rt, view, targets, adapter, shown))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if shown.last:
            await _put_back(rt, adapter, shown)
