"""The thin `lorafleet.v1.NodeAgent` servicer: message -> `Agent` call -> message.

Each method maps its errors to statuses (`status.abort`) and, for control and inference calls,
first takes a place of that class's budget (`budgets.CallBudget`).
"""

from __future__ import annotations

import functools
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
from node_agent.errors import AgentError, InvalidRequest, ShuttingDown, TooManyCalls
from node_agent.server.budgets import CallBudget
from node_agent.server.status import abort, status_code

#: The most loads one LoadAdapters call may carry (agent.proto); a call with more is refused whole.
MAX_LOADS_PER_CALL = 64

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Item = TypeVar("Item")


def _unary(
    budget: str | None = None,
) -> Callable[[Callable[[NodeAgentServicer, Req, Any], Rep]], Callable[[NodeAgentServicer, Req, Any], Rep]]:
    """Map errors of a unary method to status codes; with `budget` ("control", "inference"),
    the call must first be admitted by the servicer's budget of that class."""

    def decorate(method: Callable[[NodeAgentServicer, Req, Any], Rep]) -> Callable[[NodeAgentServicer, Req, Any], Rep]:
        @functools.wraps(method)
        def wrapper(self: NodeAgentServicer, request: Req, context: grpc.ServicerContext) -> Rep:
            try:
                with self.admitted(budget, method.__name__):
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
                with self.admitted(budget, method.__name__):
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
    def admitted(self, budget: str | None, method: str) -> Iterator[None]:
        if budget is None:
            yield
            return
        places = self.budgets[budget]
        try:
            if self.closing.is_set():
                raise ShuttingDown(f"the agent is shutting down: {method} is refused (Describe still answers)")
            places.acquire()
        except (ShuttingDown, TooManyCalls) as refusal:  # counted here: the agent never saw the call
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
        return convert.load_response(self._load(request))

    @_unary("control")
    def LoadAdapters(self, request: pb.LoadAdaptersRequest, context: grpc.ServicerContext) -> pb.LoadAdaptersResponse:
        """Each load as LoadAdapter would do it, in order, under one control place; one fails alone.
        What the ranks hold is listed once for the call (after its last load that reached them)."""
        if len(request.loads) > MAX_LOADS_PER_CALL:
            raise InvalidRequest(
                f"LoadAdapters carries {len(request.loads)} loads; at most {MAX_LOADS_PER_CALL} per call "
                f"(send the others in further calls); nothing was loaded"
            )
        outcomes: list[pb.LoadAdapterOutcome] = []
        holds: tuple[str, ...] = ()
        for load in request.loads:
            try:
                result = self._load(load)
            except AgentError as error:
                outcomes.append(pb.LoadAdapterOutcome(code=status_code(error).value[0], error_message=str(error), reason=error.reason))
            else:
                outcomes.append(pb.LoadAdapterOutcome(reply=convert.load_response(result, with_holdings=False)))
                holds = result.holds
        return pb.LoadAdaptersResponse(outcomes=outcomes, loaded_adapters=holds)

    def _load(self, request: pb.LoadAdapterRequest) -> ControlResult:
        return self.agent.load(
            request.name, request.source_uri, request.sha256, request.pinned, request.replace, credential=convert.source_credential(request)
        )

    @_unary("control")
    def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext) -> pb.UnloadAdapterResponse:
        return convert.unload_response(self.agent.unload(request.name))

    @_unary()
    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> pb.ListAdaptersResponse:
        return convert.list_response(self.agent.list_adapters(), self.agent.downloading)

    @_unary("inference")
    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardResponse:
        return convert.forward_response(self.agent.forward(convert.forward_sequences(request)))

    @_unary()
    def ProveIdentity(self, request: pb.ProveIdentityRequest, context: grpc.ServicerContext) -> pb.ProveIdentityResponse:
        return pb.ProveIdentityResponse(proof=prove_identity(self.token, self.pod_name, request.pod, request.nonce))

    @_streaming("inference")
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        for token in self.agent.generate(convert.generate_params(request), cancelled=lambda: not context.is_active()):
            yield convert.generated(token)
