"""Pinned loads: at most ``max_loras_per_batch − 1`` pinned adapters per agent (of any
namespace), counted and sent one at a time per agent under its pin lock."""

from __future__ import annotations

from lorafleet_operator.agent_values import AgentError, AgentInfo, SourceCredential
from lorafleet_operator.resources import AdapterObject
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.sending import book_sending, load_one, served_version
from lorafleet_operator.status import AgentResult, AgentState
from lorafleet_operator.view import FleetView, Target


def pin_cap(info: AgentInfo) -> int:
    """How many adapters may be pinned on one agent: ``max_loras_per_batch − 1`` (SGLang's
    rule), so one device slot per rank always stays for unpinned traffic."""
    return max(info.max_loras_per_batch - 1, 0)


async def pin_refusal(rt: Runtime, view: FleetView, target: Target, adapter: AdapterObject) -> str:
    """Why the agent cannot take this adapter pinned ("" when it can): it already holds
    :func:`pin_cap` pinned adapters (of any namespace) besides this one. Not booked as a
    failed load: nothing was sent, and the next look counts again (a pin may be released)."""
    if target.info is None:
        return ""
    try:
        registry = await rt.agents.list_adapters(target.agent.endpoint, view.creds)
    except AgentError as err:
        return f"could not count the agent's pinned adapters: {err.message}"
    pinned = sum(1 for name, entry in registry.items() if entry.pinned and name != adapter.agent_name)
    cap = pin_cap(target.info)
    if pinned < cap:
        return ""
    return (
        f"cannot pin on {target.agent.name}: it holds {pinned} pinned adapter(s) and at most "
        f"{cap} may be pinned (max_loras_per_batch {target.info.max_loras_per_batch} − 1: "
        f"one device slot stays for unpinned traffic); not loaded"
    )


async def load_pinned(
    rt: Runtime, view: FleetView, target: Target, adapter: AdapterObject, credential: SourceCredential | None
) -> AgentResult:
    """A pinned load: one at a time per agent, under the lock the count of pins is taken
    under (:func:`pin_refusal`)."""
    async with rt.locks.pin(target.agent.endpoint):
        refusal = await pin_refusal(rt, view, target, adapter)
        if refusal:
            served = await served_version(rt.agents, view, target, adapter)
            return AgentResult(target.agent.name, AgentState.FAILED, 0, target.ranks_total, refusal, served=served)
        book_sending(rt.books, target, adapter)
        return await load_one(rt.agents, rt.books, view, target, adapter, credential)
