"""The operator's single flight (shared_calls.SharedCalls): callers that need the same answer while
it is being fetched share one call; an error reaches them all; one caller giving up does not
cancel the call for the others; a call made after the last one finished is a new call."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet_operator.shared_calls import SharedCalls


class Counted:
    """A call that counts how often it is made and waits until released."""

    def __init__(self, answer: str = "listing", error: Exception | None = None) -> None:
        self.made = 0
        self.release = asyncio.Event()
        self.answer, self.error = answer, error

    async def __call__(self) -> str:
        self.made += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return f"{self.answer} {self.made}"


def test_callers_in_flight_share_one_call_then_a_new_one_is_made() -> None:
    async def scenario() -> None:
        shared: SharedCalls[str, str] = SharedCalls()
        call = Counted()
        waiting = [asyncio.ensure_future(shared.get("agent-0", call)) for _ in range(100)]
        other = Counted("other")
        apart = asyncio.ensure_future(shared.get("agent-1", other))  # another key: its own call
        await asyncio.sleep(0)
        call.release.set()
        other.release.set()
        assert await asyncio.gather(*waiting) == ["listing 1"] * 100
        assert await apart == "other 1"
        assert call.made == 1 and other.made == 1
        assert not shared.running.get("agent-0")
        later = Counted()
        later.release.set()
        assert await shared.get("agent-0", later) == "listing 1" and later.made == 1

    asyncio.run(scenario())


def test_an_error_reaches_every_caller_and_a_cancelled_caller_cancels_nothing() -> None:
    async def scenario() -> None:
        shared: SharedCalls[str, str] = SharedCalls()
        call = Counted(error=RuntimeError("agent unreachable"))
        first = asyncio.ensure_future(shared.get("agent-0", call))
        second = asyncio.ensure_future(shared.get("agent-0", call))
        third = asyncio.ensure_future(shared.get("agent-0", call))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        call.release.set()
        for caller in (second, third):
            with pytest.raises(RuntimeError, match="agent unreachable"):
                await caller
        assert first.cancelled() and call.made == 1
        assert not shared.running

    asyncio.run(scenario())
