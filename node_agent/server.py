"""The node agent's gRPC server: `lorafleet.v1.NodeAgent`, health, reflection, auth, TLS.

The servicer is thin (message -> `Agent` call -> message); `AgentError`s become status codes in
one table, `STATUS_CODES`. `create_server()` builds and binds a server without starting it;
`AgentServer.start()` / `wait()` / `stop()` run it, so tests and the CLI share one path.

Health: SERVING while every rank is alive. A watcher polls the engine; when a rank dies it
turns health NOT_SERVING and ends `wait()`, after which `lorafleet-agent serve` exits non-zero
so Kubernetes restarts the pod. Calls fail fast with UNAVAILABLE from then on.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent import convert
from node_agent.agent import Agent
from node_agent.auth import BearerTokenInterceptor, TlsFiles
from node_agent.errors import (
    AdapterConflict,
    AdapterNotFound,
    AgentError,
    CapacityExceeded,
    EngineUnavailable,
    InvalidRequest,
    RequestAborted,
    SourceNotFound,
    SourceRefused,
    SourceUnavailable,
    TooManyDownloads,
)
from node_agent.metrics import MetricsEndpoint

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["NodeAgent"].full_name
HEALTH_SERVICE_NAME = health.SERVICE_NAME
# Health is reported for the whole server ("") and for the NodeAgent service.
HEALTH_SERVICES = ("", SERVICE_NAME)

# The one place where domain errors become gRPC status codes (anything else: INTERNAL).
STATUS_CODES: dict[type[AgentError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SourceRefused: grpc.StatusCode.INVALID_ARGUMENT,
    SourceNotFound: grpc.StatusCode.NOT_FOUND,
    SourceUnavailable: grpc.StatusCode.UNAVAILABLE,
    TooManyDownloads: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    AdapterConflict: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestAborted: grpc.StatusCode.ABORTED,
    EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_code(error: AgentError) -> grpc.StatusCode:
    return STATUS_CODES.get(type(error), grpc.StatusCode.INTERNAL)


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    if isinstance(error, AgentError):
        context.abort(status_code(error), str(error))
    log.exception("unexpected error in %s", type(error).__name__)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def _unary(method: Callable[..., Any]) -> Callable[..., Any]:
    """Map errors of a unary method to status codes."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as error:
            _abort(context, error)

    return wrapper


def _streaming(method: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """Map errors of a server-streaming method to status codes, at any point of the stream."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
        except Exception as error:
            _abort(context, error)

    return wrapper


class NodeAgentServicer(agent_pb2_grpc.NodeAgentServicer):
    """`lorafleet.v1.NodeAgent` over an `Agent`."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    @_unary
    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        return convert.description(self.agent.describe())

    @_unary
    def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext) -> pb.LoadAdapterResponse:
        result = self.agent.load(request.name, request.source_uri, request.sha256, request.pinned, request.replace)
        return convert.load_response(result)

    @_unary
    def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext) -> pb.UnloadAdapterResponse:
        return convert.unload_response(self.agent.unload(request.name))

    @_unary
    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> pb.ListAdaptersResponse:
        return convert.list_response(self.agent.list_adapters())

    @_unary
    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardResponse:
        return convert.forward_response(self.agent.forward(convert.forward_sequences(request)))

    @_streaming
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        for token in self.agent.generate(convert.generate_params(request), cancelled=lambda: not context.is_active()):
            yield convert.generated(token)


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and who may call it."""

    listen: str = "127.0.0.1:0"  # HOST:PORT; port 0 picks a free one (see AgentServer.port)
    auth_token: str | None = None
    tls: TlsFiles | None = None
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    max_workers: int = 32  # concurrent calls; a Generate stream holds one for its duration
    health_poll_s: float = 0.25
    stop_grace_s: float = 10.0


class AgentServer:
    """A bound gRPC server over one agent, with its health watcher and metrics endpoint."""

    def __init__(
        self, agent: Agent, server: grpc.Server, health_servicer: health.HealthServicer, port: int, options: ServerOptions
    ) -> None:
        self.agent = agent
        self.server = server
        self.health = health_servicer
        self.port = port
        self.options = options
        self._metrics: MetricsEndpoint | None = None
        self._done = threading.Event()
        self._engine_died = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        self._set_health(self.agent.alive)
        self.server.start()
        if self.options.metrics_port is not None:
            self._metrics = MetricsEndpoint(self.agent.metrics, self.options.metrics_port)
        self._watcher = threading.Thread(target=self._watch, name="lorafleet-health", daemon=True)
        self._watcher.start()

    @property
    def metrics_port(self) -> int | None:
        """The bound metrics port while the endpoint is open (None: no metrics endpoint)."""
        return self._metrics.port if self._metrics else None

    def wait(self) -> bool:
        """Block until `request_stop()` or the engine's death; True if the engine died."""
        while not self._done.wait(1.0):  # a timed wait lets signal handlers run promptly
            pass
        return self._engine_died.is_set()

    def request_stop(self) -> None:
        """Make `wait()` return (safe from a signal handler: sets an event, nothing else)."""
        self._done.set()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving: health NOT_SERVING, running calls get `grace` seconds, then cancelled."""
        self._done.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(self.options.stop_grace_s if grace is None else grace).wait()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def __enter__(self) -> AgentServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0)

    def _watch(self) -> None:
        while not self._done.wait(self.options.health_poll_s):
            if not self.agent.alive:
                log.error("engine is not serving (%s): health NOT_SERVING, calls fail with UNAVAILABLE", self.agent.failure())
                self._set_health(False)
                self._engine_died.set()
                self._done.set()
                return

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_SERVICES:
            self.health.set(service, status)


def create_server(agent: Agent, options: ServerOptions = ServerOptions()) -> AgentServer:
    """Build and bind (not start) a server for `agent`: NodeAgent, health, reflection, auth, TLS."""
    interceptors = [BearerTokenInterceptor(options.auth_token)] if options.auth_token else []
    server = grpc.server(
        ThreadPoolExecutor(max_workers=options.max_workers, thread_name_prefix="lorafleet-grpc"),
        interceptors=interceptors,
        # Without this, Linux lets a second server bind the same port and steal half the calls.
        options=[("grpc.so_reuseport", 0)],
    )
    agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentServicer(agent), server)
    # Non-blocking Watch: probe streams do not hold worker threads.
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        if options.tls is not None:
            port = server.add_secure_port(options.listen, options.tls.server_credentials())
        else:
            port = server.add_insecure_port(options.listen)
    except RuntimeError as error:
        raise OSError(f"cannot listen on {options.listen}: {error}") from error
    if not port:
        raise OSError(f"cannot listen on {options.listen}")
    return AgentServer(agent, server, health_servicer, port, options)
