"""An s3:// or oci:// source resolved once, before its loads go out (the ``ResolveSource`` call).

An adapter whose s3:// or oci:// source has no ``status.source`` record for its URI yet is
resolved by one agent of its loads (the first that answers: one unreachable, busy, too old to
know the call or failing on its own passes the question on to the next): an oci:// tag to its
manifest digest, an s3:// prefix to its objects' version ids or ETags. The answer is written
to ``status.source`` first; then every load is sent held to it
(`source_revisions.held_revision`), so a tag moved or an object overwritten between two
agents' loads is refused on the later one (``tag_moved``, ``source_changed``) instead of
loading other content. A refusal of the source (not allowed, traversal, a registry's or a
store's refusal, not found) is every due agent's result, as its load's refusal would be,
booked in the back-off book: nothing is sent. When no agent could answer, the loads are not
sent either (each agent's own failure is its result, booked as a load's: Unreachable ones
retried on the transient back-off); when an agent asked is too old for the call
(UNIMPLEMENTED: a fleet being upgraded), they are sent as before, each agent resolving the
source on its own load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc

from lorafleet_common.sources import scheme_of
from lorafleet_operator.agent_values import AgentError, SourceCredential, SourceRevision
from lorafleet_operator.crashes import answered, incarnation
from lorafleet_operator.resources import AdapterObject
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.sending import error_result, served_version
from lorafleet_operator.source_revisions import HELD_SCHEMES, MAX_REVISION, held_revision
from lorafleet_operator.status import AgentResult, ServedVersion
from lorafleet_operator.view import FleetView, Target

log = logging.getLogger(__name__)

#: The codes of an agent's refusal of the source itself (agent.proto: a source refused, or not
#: found), which any other agent would answer too; any other failure is the agent's own.
SOURCE_REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND})


@dataclass(frozen=True)
class Resolution:
    """What resolving before the loads came to: the adapter as its loads are to be sent (with
    ``status.source`` when it was resolved now), the record made (None when none was), and
    the due targets' results when nothing is to be sent (None: send the loads)."""

    adapter: AdapterObject
    source: SourceRevision | None = None
    unsent: list[AgentResult] | None = None


def needs_resolution(adapter: AdapterObject) -> bool:
    """Whether the adapter's source is one whose revision loads are held to, and its status
    records none for this URI yet."""
    uri = adapter.spec.source.uri
    return scheme_of(uri) in HELD_SCHEMES and not held_revision(uri, adapter.status)


async def resolve_once(
    rt: Runtime, view: FleetView, due: Sequence[Target], adapter: AdapterObject, credential: SourceCredential | None
) -> Resolution:
    """Resolve the adapter's source through the first of the ``due`` targets (those whose
    loads are to be sent) that answers, and record it in ``status.source`` before any load is
    sent (see the module docstring); nothing to do when it needs none or none is due."""
    if not due or not needs_resolution(adapter):
        return Resolution(adapter)
    uri = adapter.spec.source.uri
    failed: list[tuple[Target, AgentError]] = []
    for target in due:
        try:
            revision = await rt.agents.resolve_source(target.agent.endpoint, view.creds, uri, credential)
        except AgentError as error:
            if error.code in SOURCE_REFUSALS and error.reason:  # the source's refusal, every agent's
                return Resolution(adapter, unsent=await _booked(rt, view, adapter, [(t, error) for t in due]))
            failed.append((target, error))  # this agent's own failure: the next one is asked
            continue
        if not revision or len(revision) > MAX_REVISION:  # nothing status can hold: loads resolve it as before
            return Resolution(adapter)
        return await _recorded(rt, adapter, SourceRevision(uri, revision))
    if any(error.code == grpc.StatusCode.UNIMPLEMENTED for _, error in failed):
        log.info("%s/%s: an agent older than ResolveSource; each load resolves %s itself", adapter.namespace, adapter.name, uri)
        return Resolution(adapter)
    return Resolution(adapter, unsent=await _booked(rt, view, adapter, failed))


def held_to(result: AgentResult, source: SourceRevision | None) -> AgentResult:
    """A load's result with the revision it was held to (``source``, resolved before it was
    sent) when its agent reported none (it failed, or was not sent): the status keeps the
    record even when no load succeeded, so a retry is held to the same revision."""
    if source is None or result.source is not None:
        return result
    return replace(result, source=source)


async def _recorded(rt: Runtime, adapter: AdapterObject, source: SourceRevision) -> Resolution:
    """``status.source`` written (a merge patch of that field alone), then the adapter as its
    loads are to be sent."""
    record = source.to_status()
    await rt.kube.patch_adapter_status(adapter.namespace, adapter.name, {"source": record})
    log.info("%s/%s: %s resolved to %s before its loads", adapter.namespace, adapter.name, source.uri, source.revision)
    return Resolution(adapter.with_status({**adapter.status, "source": record}), source)


async def _booked(rt: Runtime, view: FleetView, adapter: AdapterObject, failures: Sequence[tuple[Target, AgentError]]) -> list[AgentResult]:
    """Each target's result after the resolution failed this way (Failed for a refusal,
    Unreachable for an agent that could not answer), booked in the back-off book as a
    failed load's would be; where the agent answers, the version it still serves (an earlier
    URI's, when the spec changed to one refused here), as a failed load's result says."""
    served = await asyncio.gather(*(_still_served(rt, view, target, adapter, error) for target, error in failures))
    return [
        rt.books.failures.remember(
            adapter.failure_key(target.agent.name), incarnation(target.agent), replace(error_result(target, error), served=version)
        )
        for (target, error), version in zip(failures, served, strict=True)
    ]


async def _still_served(rt: Runtime, view: FleetView, target: Target, adapter: AdapterObject, error: AgentError) -> ServedVersion | None:
    """The version the agent still serves, asked only where the failure shows it answers."""
    return await served_version(rt.agents, view, target, adapter) if answered(error) else None
