"""Asking every agent of a fleet at once: Describe (what each agent is) and ListAdapters
(what each holds), cached per pod life and shared while in flight, so a thousand reconciles
at once ask each agent once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from lorafleet_common.registry import RegistryEntry
from lorafleet_operator.agent_values import AgentError, AgentInfo, Credentials
from lorafleet_operator.books import Listing
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.runtime import PodLife, Runtime
from lorafleet_operator.view import FleetView, Registry

T = TypeVar("T")


async def ask_each(agents: Sequence[AgentPod], call: Callable[[AgentPod], Awaitable[T]]) -> dict[str, T | AgentError]:
    """``call`` on every agent at once; by pod name, its answer or the AgentError it raised."""

    async def one(agent: AgentPod) -> T | AgentError:
        try:
            return await call(agent)
        except AgentError as err:
            return err

    answers = await asyncio.gather(*(one(a) for a in agents))
    return {a.name: answer for a, answer in zip(agents, answers, strict=True)}


def all_cached(agents: Sequence[AgentPod], cached: Callable[[AgentPod], T | None]) -> dict[str, T] | None:
    """Every agent's cached answer by pod name, or None when one has none: the reconciles
    of a thousand adapters then take the answers without a task per agent each."""
    answers: dict[str, T] = {}
    for agent in agents:
        answer = cached(agent)
        if answer is None:
            return None
        answers[agent.name] = answer
    return answers


def _life(agent: AgentPod) -> PodLife:
    return (agent.uid, agent.restarts, agent.endpoint)


async def describe_all(rt: Runtime, agents: Sequence[AgentPod], creds: Credentials, *, fresh: bool) -> dict[str, AgentInfo | AgentError]:
    """Describe every dialable agent (cached per pod life unless ``fresh``; reconciles that
    find no answer cached share the call in flight)."""
    known = rt.caches.describes_known

    async def ask(agent: AgentPod) -> AgentInfo:
        info = known[_life(agent)] = await rt.agents.describe(agent.endpoint, creds)
        return info

    async def describe(agent: AgentPod) -> AgentInfo:
        if fresh:
            return await ask(agent)
        cached = known.get(_life(agent))
        if cached is not None:
            return cached
        return await rt.caches.describes.get(_life(agent), lambda: ask(agent))

    dialable = [a for a in agents if a.dialable]
    rt.agents.observe(dialable)  # a new pod at an endpoint proves again
    if not fresh:
        cached = all_cached(dialable, lambda a: known.get(_life(a)))
        if cached is not None:
            return dict(cached)
    return await ask_each(dialable, describe)


async def list_registries(rt: Runtime, view: FleetView, *, fresh: bool = True) -> dict[str, Registry]:
    """ListAdapters on every dialable agent at once; each answer also ends the reservations
    it now accounts for (:class:`~lorafleet_operator.placement.Reservations`). Unless
    ``fresh``, an agent listed less than a drift interval ago by the same pod is not asked
    again: its last listing plus the reservations since says what it holds (placement in a
    handler; the drift check always lists afresh). Handlers that find no such listing share
    the one in flight for that pod (:class:`~lorafleet_operator.shared_calls.SharedCalls`):
    a thousand adapters created at once ask each agent once, not a thousand times. The
    listings returned are shared and read-only."""
    books = rt.books

    async def ask(agent: AgentPod) -> Listing:
        requested_at = time.monotonic()
        registry = await rt.agents.list_adapters(agent.endpoint, view.creds)
        books.reservations.listed(agent.endpoint, requested_at)
        listing = Listing(requested_at, (agent.uid, agent.restarts), registry)
        newest = books.registries.get(agent.endpoint)
        # Two listings of one agent may answer out of order (the drift check's and a
        # handler's): the one kept is the latest requested, which deletions trust.
        if newest is None or newest.requested_at <= requested_at:
            books.registries[agent.endpoint] = listing
            books.sent.listed(agent.endpoint, requested_at)
        return listing

    def recent(agent: AgentPod) -> Mapping[str, RegistryEntry] | None:
        cached = books.registries.get(agent.endpoint)
        if (
            cached is not None
            and cached.life == (agent.uid, agent.restarts)
            and time.monotonic() - cached.requested_at < rt.settings.drift_interval_s
        ):
            return cached.entries
        return None

    async def listing(agent: AgentPod) -> Mapping[str, RegistryEntry]:
        if fresh:
            return (await ask(agent)).entries
        entries = recent(agent)
        if entries is not None:
            return entries
        life = (agent.uid, agent.restarts)
        return (await rt.caches.listings.get((agent.endpoint, life), lambda: ask(agent))).entries

    dialable = view.dialable
    if not fresh:
        cached = all_cached(dialable, recent)
        if cached is not None:
            return dict(cached)
    return await ask_each(dialable, listing)
