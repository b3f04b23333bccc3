"""The thin `lorafleet.v1.NodeAgent` servicer: message -> `Agent` call -> message.

Each method maps its errors to statuses (`status.abort`) and, for control and inference calls,
first takes a place of that class's budget (`budgets.CallBudget`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent import convert
from node_agent.agent import Agent
from node_agent.auth import prove_identity
from node_agent.engine import ControlResult
from node_agent.errors import AgentError, DeadlineExceeded, InvalidRequest, LoadCancelled, ShuttingDown, TooManyCalls
from node_agent.server.budgets import CallBudget
from node_agent.server.status import abort, status_code
from node_agent.sources import SourceAccess, source_revision

#: The most loads one LoadAdapters call may carry (agent.proto); a call with more is refused whole.
MAX_LOADS_PER_CALL = 64

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Item = TypeVar("Item")

log = logging.getLogger(__name__)


def _ended(context: grpc.ServicerContext) -> Callable[[], bool]:
    """Whether the call has ended: its client's deadline passed, or it cancelled or went away."""
    return lambda: not context.is_active()


def _batch_cancelled(request: pb.LoadAdaptersRequest, done: int, loaded: list[str]) -> LoadCancelled:
    """A LoadAdapters call that ended with `done` of its loads tried: the loads that stay are
    logged (the caller never reads the reply); the error that ends the call."""
    names = [load.name for load in request.loads]
    log.warning(
        "LoadAdapters ended by its caller (deadline or cancel) with %d of %d loads tried: loaded and kept: %s; not loaded: %s",
        done,
        len(names),
        ", ".join(loaded) or "none",
        ", ".join(name for name in names if name not in loaded) or "none",
    )
    return LoadCancelled(f"LoadAdapters was cancelled with {done} of {len(names)} loads tried; the others were not loaded")


def _unary(
    budget: str | None = None,
) -> Callable[[Callable[[NodeAgentServicer, Req, Any], Rep]], Callable[[NodeAgentServicer, Req, Any], Rep]]:
    """Map errors of a unary method to status codes; with `budget` ("control", "inference"),
    the call must first be admitted by the servicer's budget of that class."""

    def decorate(method: Callable[[NodeAgentServicer, Req, Any], Rep]) -> Callable[[NodeAgentServicer, Req, Any], Rep]:
        @functools.wraps(method)
        def wrapper(self: NodeAgentServicer, request: Req, context: grpc.ServicerContext) -> Rep:
            try:
                with self.admitted(budget, method.__name__, context):
                    return method(self, request, context)
            except Exception as error:
                abort(context, error)

        return wrapper

    return decorate


def _streaming(
    budget: str,
) -> Callable[[Callable[[NodeAgentServicer, Req, Any], Iterator[Item]]], Callable[[NodeAgentServicer, Req, Any], Iterator[Item]]]:
    """Map errors of a server-streaming method to status codes, at any point of the stream; the
    stream holds a place of `budget` until it ends."""

    def decorate(
        method: Callable[[NodeAgentServicer, Req, Any], Iterator[Item]],
    ) -> Callable[[NodeAgentServicer, Req, Any], Iterator[Item]]:
        @functools.wraps(method)
        def wrapper(self: NodeAgentServicer, request: Req, context: grpc.ServicerContext) -> Iterator[Item]:
            try:
                with self.admitted(budget, method.__name__, context):
                    yield from method(self, request, context)
            except Exception as error:
                abort(context, error)

        return wrapper

    return decorate


class NodeAgentServicer(agent_pb2_grpc.NodeAgentServicer):
    """`lorafleet.v1.NodeAgent` over an `Agent`, with a budget for control and for inference calls."""

    def __init__(
        self, agent: Agent, control: CallBudget, inference: CallBudget, token: str | None = None, pod_name: str | None = None
    ) -> None:
        self.agent = agent
        self.token, self.pod_name = token, pod_name  # for ProveIdentity
        self.budgets = {"control": control, "inference": inference}
        self.closing = threading.Event()  # set by AgentServer.stop(): only Describe, ListAdapters, health

    @contextmanager
    def admitted(self, budget: str | None, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Hold a place of `budget` while the call runs, waiting in its queue within the call's
        deadline; a call that ends while it waits leaves the queue."""
        if budget is None:
            yield
            return
        places = self.budgets[budget]
        try:
            if self.closing.is_set():
                raise ShuttingDown(f"the agent is shutting down: {method} is refused (Describe still answers)")
            places.acquire(context.time_remaining(), context.add_callback)
        except (ShuttingDown, TooManyCalls, DeadlineExceeded) as refusal:  # counted here: the agent never saw the call
            operation = {"LoadAdapter": "load", "LoadAdapters": "load", "UnloadAdapter": "unload"}.get(method, method.lower())
            self.agent.metrics.failures.labels(operation, refusal.reason).inc()
            raise
        try:
            yield
        finally:
            places.release()

    @_unary()
    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        return convert.description(self.agent.describe())

    @_unary("control")
    def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext) -> pb.LoadAdapterResponse:
        result = self._load(request, _ended(context))
        return convert.load_response(result, after=self.agent.after_load(request.name, result))

    @_unary("control")
    def LoadAdapters(self, request: pb.LoadAdaptersRequest, context: grpc.ServicerContext) -> pb.LoadAdaptersResponse:
        """Each load as LoadAdapter would do it, in order, under one control place; one fails alone.
        What the ranks hold is listed once for the call (after its last load that reached them).
        A call that ends (its deadline, a cancel) stops: its running load before the ranks, the
        later ones never start; loads done before stay, named in a log line (docs/agent.md)."""
        if len(request.loads) > MAX_LOADS_PER_CALL:
            raise InvalidRequest(
                f"LoadAdapters carries {len(request.loads)} loads; at most {MAX_LOADS_PER_CALL} per call "
                f"(send the others in further calls); nothing was loaded"
            )
        outcomes: list[pb.LoadAdapterOutcome] = []
        holds: tuple[str, ...] = ()
        cancelled = _ended(context)
        loaded: list[str] = []  # the loads that succeeded (reported if the call ends)
        for done, load in enumerate(request.loads):
            if cancelled():
                raise _batch_cancelled(request, done, loaded)
            try:
                result = self._load(load, cancelled)
            except AgentError as error:
                outcomes.append(pb.LoadAdapterOutcome(code=status_code(error).value[0], error_message=str(error), reason=error.reason))
            else:
                after = self.agent.after_load(load.name, result)
                outcomes.append(pb.LoadAdapterOutcome(reply=convert.load_response(result, with_holdings=False, after=after)))
                holds = result.holds
                if result.ok:
                    loaded.append(load.name)
        return pb.LoadAdaptersResponse(outcomes=outcomes, loaded_adapters=holds)

    def _load(self, request: pb.LoadAdapterRequest, cancelled: Callable[[], bool]) -> ControlResult:
        return self.agent.load(
            request.name,
            request.source_uri,
            request.sha256,
            request.pinned,
            request.replace,
            SourceAccess(convert.source_credential(request), request.source_revision),
            standby=request.standby,
            cancelled=cancelled,
        )

    @_unary("control")
    def ResolveSource(self, request: pb.ResolveSourceRequest, context: grpc.ServicerContext) -> pb.ResolveSourceResponse:
        """What the source resolves to now, under the agent's source policy (no copy is made)."""
        revision = source_revision(request.source_uri, self.agent.config.sources, convert.source_credential(request))
        return pb.ResolveSourceResponse(source_revision=revision)

    @_unary("control")
    def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext) -> pb.UnloadAdapterResponse:
        return convert.unload_response(self.agent.unload(request.name))

    @_unary()
    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> pb.ListAdaptersResponse:
        return convert.list_response(self.agent.list_adapters(), self.agent.downloading)

    @_unary("inference")
    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardResponse:
        return convert.forward_response(self.agent.forward(convert.forward_sequences(request)))

    @_unary()  # no budget: it asks no rank, and demand must be measurable while loads and inference are busy
    def AdapterStats(self, request: pb.AdapterStatsRequest, context: grpc.ServicerContext) -> pb.AdapterStatsResponse:
        return convert.adapter_stats_response(self.agent.adapter_stats())

    @_unary()
    def ProveIdentity(self, request: pb.ProveIdentityRequest, context: grpc.ServicerContext) -> pb.ProveIdentityResponse:
        return pb.ProveIdentityResponse(proof=prove_identity(self.token, self.pod_name, request.pod, request.nonce))

    @_streaming("inference")
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        for token in self.agent.generate(convert.generate_params(request), cancelled=lambda: not context.is_active()):
            yield convert.generated(token)
