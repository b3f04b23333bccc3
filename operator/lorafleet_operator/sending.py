"""Sending loads: one LoadAdapter call (or several loads of one agent in one LoadAdapters
call: the load queue's sending, ``Runtime.loads``), and the ledgers each answer updates (the
loads sent, the reservations, the crash book, the back-off book).

Its functions take the agent clients and the books, not the whole runtime: the runtime makes
the load queue with them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.agent_values import AgentError, ControlReply, LoadAnswer, LoadRequest, SourceCredential
from lorafleet_operator.books import Books
from lorafleet_operator.crashes import CrashBook, answered, died_under, incarnation
from lorafleet_operator.failures import AgentFailure, agent_state, failure_message
from lorafleet_operator.resources import AdapterObject
from lorafleet_operator.source_revisions import held_revision
from lorafleet_operator.status import AgentResult, AgentState, ServedVersion
from lorafleet_operator.view import FleetView, Target


def loaded_result(target: Target, reply: ControlReply) -> AgentResult:
    """A target that holds the adapter after a successful load reply: on standby (no rank) when
    it was sent on standby and the agent does not say its ranks hold it, else loaded."""
    total = target.ranks_total or reply.ranks_reported
    if target.standby and reply.on_standby is not False:
        return AgentResult(target.agent.name, AgentState.STANDBY, 0, total, source=reply.source)
    ranks = reply.ranks_ok if reply.ranks_reported else total
    return AgentResult(target.agent.name, AgentState.LOADED, ranks, total, source=reply.source)


def error_result(target: Target, failure: AgentFailure) -> AgentResult:
    """A target whose call failed: Unreachable or Failed as the policy classifies it."""
    return AgentResult(
        target.agent.name, agent_state(failure), 0, target.ranks_total, failure_message(failure, "the agent refused the adapter")
    )


async def served_version(agents: AgentClients, view: FleetView, target: Target, adapter: AdapterObject) -> ServedVersion | None:
    """The version of the adapter the agent still holds after a failed load (its registry
    entry, when it differs from the spec: a failed replace keeps the old weights routed);
    None when it holds none or its registry cannot be listed now."""
    try:
        registry = await agents.list_adapters(target.agent.endpoint, view.creds)
    except AgentError:
        return None
    entry = registry.get(adapter.agent_name)
    return ServedVersion(entry.source_uri, entry.sha256) if entry is not None else None


def book_sending(books: Books, target: Target, adapter: AdapterObject) -> None:
    """Book a load as sent from now: counted as held while in flight (placement: a reconcile
    placing meanwhile sees it, even while it waits in the agent's queue), and unsettled until
    it ends answered (a load cut off may still complete there)."""
    books.reservations.reserve(target.agent.endpoint, adapter.agent_name)
    books.sent.sending(target.agent.endpoint, adapter.agent_name)


def book_never_sent(books: Books, target: Target, adapter: AdapterObject) -> None:
    """Undo :func:`book_sending` for a queued load its caller gave up before it was sent."""
    now = time.monotonic()
    books.sent.ended(target.agent.endpoint, adapter.agent_name, now, answered=True)
    books.reservations.finished(target.agent.endpoint, adapter.agent_name, now, loaded=False)


def load_request(adapter: AdapterObject, credential: SourceCredential | None, *, standby: bool = False) -> LoadRequest:
    """The load the adapter's spec asks of an agent (replace: the spec is the truth for
    managed names), with its source's credential and the revision its status records;
    ``standby``: held on disk, loaded to a slot by its first request."""
    source = adapter.spec.source
    revision = held_revision(source.uri, adapter.status)
    return LoadRequest(
        adapter.agent_name,
        source.uri,
        source.sha256,
        adapter.spec.pinned,
        replace=True,
        credential=credential,
        revision=revision,
        standby=standby,
    )


async def load_one(
    agents: AgentClients, books: Books, view: FleetView, target: Target, adapter: AdapterObject, credential: SourceCredential | None
) -> AgentResult:
    """The LoadAdapter call itself (with the source's credential; booked as sent before:
    :func:`book_sending`) and the books (:func:`book_answer`)."""
    answer: LoadAnswer
    try:
        answer = await agents.load(
            target.agent.endpoint,
            view.creds,
            load_request(adapter, credential, standby=target.standby),
            exclusive=books.crashes.isolate(adapter.generation_key),
            namespace=adapter.namespace,
        )
    except AgentError as err:
        answer = err
    return await answer_result(agents, books, QueuedLoad(view, target, adapter, credential), book_answer(books, target, adapter, answer))


@dataclass(frozen=True)
class QueuedLoad:
    """A load of a local source waiting in its agent's queue (``Runtime.loads``), booked as
    sent (:func:`book_sending`)."""

    view: FleetView
    target: Target
    adapter: AdapterObject
    credential: SourceCredential | None


def loads_join(crashes: CrashBook, first: QueuedLoad, other: QueuedLoad) -> bool:
    """Whether ``other`` may go in the same LoadAdapters call as ``first`` (the queue asks
    when it sends): the same credentials, and neither generation is to load alone
    (:meth:`~lorafleet_operator.failures.CrashBook.isolate`)."""
    return (
        first.view.creds == other.view.creds
        and not crashes.isolate(first.adapter.generation_key)
        and not crashes.isolate(other.adapter.generation_key)
    )


async def send_loads(agents: AgentClients, books: Books, loads: Sequence[QueuedLoad]) -> list[AgentResult]:
    """Send the queued loads of one agent (``Runtime.loads``): one alone as LoadAdapter (it
    may be exclusive), several in one LoadAdapters call
    (:meth:`~lorafleet_operator.agent_client.AgentClients.load_many`); each load's books as
    after its own call (:func:`book_answer`, every one before any failure's registry read).
    Their results in their order."""
    if len(loads) == 1:
        one = loads[0]
        return [await load_one(agents, books, one.view, one.target, one.adapter, one.credential)]
    first = loads[0]
    answers = await agents.load_many(
        first.target.agent.endpoint, first.view.creds, [load_request(q.adapter, q.credential, standby=q.target.standby) for q in loads]
    )
    booked = [book_answer(books, q.target, q.adapter, answer) for q, answer in zip(loads, answers, strict=True)]
    return [await answer_result(agents, books, q, b) for q, b in zip(loads, booked, strict=True)]


def book_answer(books: Books, target: Target, adapter: AdapterObject, answer: LoadAnswer) -> AgentResult | AgentFailure:
    """The books after one load's answer (the loads sent, the reservations, the crash book):
    the loaded result (its back-off cleared), or how it failed."""
    key, pod = adapter.generation_key, target.agent.name
    name, endpoint = adapter.agent_name, target.agent.endpoint
    now = time.monotonic()
    if isinstance(answer, AgentError):
        books.sent.ended(endpoint, name, now, answered=answered(answer))
        books.reservations.finished(endpoint, name, now, loaded=False)
        if died_under(answer):
            books.crashes.suspect(key, pod, incarnation(target.agent), alone=answer.alone, message=answer.message)
        else:
            books.crashes.answered(key, pod, loaded=False)
        return answer
    books.sent.ended(endpoint, name, now, answered=True)
    books.reservations.finished(endpoint, name, now, loaded=answer.success)
    books.crashes.answered(key, pod, loaded=answer.success)
    if answer.success:
        return books.failures.remember(adapter.failure_key(pod), incarnation(target.agent), loaded_result(target, answer))
    return answer


async def answer_result(agents: AgentClients, books: Books, load: QueuedLoad, booked: AgentResult | AgentFailure) -> AgentResult:
    """A load's result from its books (:func:`book_answer`): a failure the agent answered
    also says which version it still serves; booked in the back-off book."""
    if isinstance(booked, AgentResult):
        return booked
    result = error_result(load.target, booked)
    if answered(booked):
        result = replace(result, served=await served_version(agents, load.view, load.target, load.adapter))
    return books.failures.remember(load.adapter.failure_key(load.target.agent.name), incarnation(load.target.agent), result)
