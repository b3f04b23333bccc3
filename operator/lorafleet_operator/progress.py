"""A long load's progress in the adapter's Ready condition.

While a handler's loads of a remote source (http(s), hf://) run, a side task asks each target
agent every :data:`INTERVAL_S` which downloads it is running (``ListAdapters.downloading``: the
agent answers from memory, without waiting on the load) and writes the bytes per agent into the
Ready condition's message, e.g. "Loading: downloading the source: agent-0 1.5 of 4.4 MiB,
agent-1 0.8 of 4.4 MiB". The loads themselves never wait on it. When they end, a message it
wrote is put back as it was, so the handler's own status write (which compares with the status
from before the loads) decides what the condition says afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from lorafleet_operator import sources
from lorafleet_operator.agent_values import AgentError
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


def with_ready_message(conditions: Sequence[Mapping[str, Any]], message: str) -> list[dict[str, Any]]:
    """The conditions, the Ready one with ``message`` (its status, reason and time kept)."""
    return [{**c, "message": message} if c.get("type") == "Ready" else dict(c) for c in conditions]


async def _patch_conditions(rt: Runtime, adapter: AdapterObject, conditions: Sequence[Mapping[str, Any]]) -> bool:
    """Write the conditions; False (logged) when the API refused or failed: best effort."""
    try:
        await rt.kube.patch_adapter_status(adapter.namespace, adapter.name, {"conditions": list(conditions)})
    except (ApiException, urllib3.exceptions.HTTPError) as err:
        log.warning("could not write the load progress of %s/%s: %s", adapter.namespace, adapter.name, err)
        return False
    return True


async def _report(rt: Runtime, view: FleetView, targets: Sequence[Target], adapter: AdapterObject, written: list[str]) -> None:
    """Every INTERVAL_S, the targets' downloads of this adapter into its Ready message; each
    message written is appended to ``written``."""
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
        if (
            message
            and message != (written[-1] if written else "")
            and await _patch_conditions(rt, adapter, with_ready_message(_latest(rt, adapter), message))
        ):
            written.append(message)


@contextlib.asynccontextmanager
async def reporting(rt: Runtime, view: FleetView, targets: Sequence[Target], adapter: AdapterObject) -> AsyncIterator[None]:
    """Report the loads' download progress while the block runs (remote sources only); then put
    the Ready condition back as it was if a progress message was written."""
    # A correction a drift check made during an earlier handler is older than this handler's copy.
    rt.books.corrected_conditions.pop((adapter.namespace, adapter.name), None)
    conditions = adapter.status.get("conditions") or []
    if not targets or not conditions or not sources.is_remote(adapter.spec.source.uri):
        yield
        return
    written: list[str] = []
    task = asyncio.create_task(_report(rt, view, targets, adapter, written))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if written:
            await _patch_conditions(rt, adapter, _latest(rt, adapter))
        rt.books.corrected_conditions.pop((adapter.namespace, adapter.name), None)


def _latest(rt: Runtime, adapter: AdapterObject) -> list[dict[str, Any]]:
    """The adapter's conditions as last written: the handler's copy from its start, or those a
    drift check wrote since while correcting its claims (``claims``), never set back."""
    corrected = rt.books.corrected_conditions.get((adapter.namespace, adapter.name))
    return corrected if corrected is not None else [dict(c) for c in adapter.status.get("conditions") or []]
