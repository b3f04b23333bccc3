"""The node agent's gRPC server: `lorafleet.v1.NodeAgent`, health, reflection, auth, TLS.

The servicer is thin (message -> `Agent` call -> message); `AgentError`s become status codes in
one table, `STATUS_CODES`. `create_server()` builds and binds a server without starting it;
`AgentServer.start()` / `wait()` / `stop()` run it, so tests and the CLI share one path.

Budgets: health, Describe and ListAdapters never queue behind control or inference calls. The
thread pool has room for `max_control_calls` control calls (LoadAdapter, LoadAdapters, UnloadAdapter),
`max_inference_calls` inference calls (Forward, Generate streams) and `reserved_workers` more
for everything else; a control or inference call beyond its budget is refused at once with
RESOURCE_EXHAUSTED (`TooManyCalls`), so neither class can take the others' threads.

Health: SERVING while every rank is alive and no engine command has run longer than the agent's
`engine_hang_timeout_s` (a hung engine is NOT_SERVING until the command completes). A watcher
polls the engine; when a rank dies it turns health NOT_SERVING and ends `wait()`, after which
`lorafleet-agent serve` keeps answering Describe for `exit_linger_s`, then exits non-zero so
Kubernetes restarts the pod. Calls fail fast with UNAVAILABLE from then on.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from lorafleet_common.wire import REASON_METADATA_KEY
from node_agent import convert
from node_agent.agent import Agent
from node_agent.auth import BearerTokenInterceptor, TlsFiles, prove_identity
from node_agent.engine import ControlResult
from node_agent.errors import (
    AdapterConflict,
    AdapterNotFound,
    AgentError,
    CapacityExceeded,
    EngineUnavailable,
    InvalidRequest,
    RequestAborted,
    ShuttingDown,
    SourceNotFound,
    SourceRefused,
    SourceUnavailable,
    TooManyCalls,
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
    TooManyCalls: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    AdapterConflict: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestAborted: grpc.StatusCode.ABORTED,
    EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_code(error: AgentError) -> grpc.StatusCode:
    return STATUS_CODES.get(type(error), grpc.StatusCode.INTERNAL)


def _abort(context: grpc.ServicerContext, error: Exception) -> NoReturn:
    if isinstance(error, AgentError):
        # The reason marks the answer as the agent's own (the operator tells it from a crash).
        context.set_trailing_metadata(((REASON_METADATA_KEY, error.reason),))
        context.abort(status_code(error), str(error))
    log.exception("unexpected error in %s", type(error).__name__)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
    raise AssertionError("grpc's context.abort returned")  # it raises; this tells the type checker


class CallBudget:
    """At most `limit` calls of one class at once; one more is refused at once, never queued."""

    def __init__(self, what: str, limit: int, flag: str) -> None:
        if limit < 1:
            raise ValueError(f"{flag} must be at least 1, got {limit}")
        self.what, self.limit, self.flag = what, limit, flag
        self.running = 0
        self._idle = threading.Condition()

    def acquire(self) -> None:
        """Take a place, or raise `TooManyCalls` at once (no waiting)."""
        with self._idle:
            if self.running >= self.limit:
                raise TooManyCalls(
                    f"too many concurrent {self.what} calls: {self.running} running, the limit is {self.limit} ({self.flag}); retry later"
                )
            self.running += 1

    def release(self) -> None:
        with self._idle:
            self.running -= 1
            self._idle.notify_all()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no call of this class runs, or `deadline` (time.monotonic()) passes."""
        with self._idle:
            while self.running:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
            return True


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
                _abort(context, error)

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
                _abort(context, error)

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


DEFAULT_MAX_CONTROL_CALLS = 16
#: The most loads one LoadAdapters call may carry (agent.proto); a call with more is refused whole.
MAX_LOADS_PER_CALL = 64
DEFAULT_MAX_INFERENCE_CALLS = 32
DEFAULT_RESERVED_WORKERS = 8
DEFAULT_EXIT_LINGER_S = 5.0
RESPONSE_FLUSH_S = 5.0  # stop(): the longest wait for responses of calls that already returned


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and who may call it."""

    listen: str = "127.0.0.1:0"  # HOST:PORT; port 0 picks a free one (see AgentServer.port)
    auth_token: str | None = None
    # "NAMESPACE/NAME" of this agent's pod (--pod-name): identity challenges for another pod are
    # not answered (a relay). None: answered for any pod (an agent behind several pods).
    pod_name: str | None = None
    tls: TlsFiles | None = None
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    # HOST:PORT of a plaintext listener serving grpc.health.v1 only, for probes that cannot speak
    # TLS or send a token (kubelet's gRPC probes); None: none.
    health_listen: str | None = None
    max_control_calls: int = DEFAULT_MAX_CONTROL_CALLS  # LoadAdapter + UnloadAdapter at once
    max_inference_calls: int = DEFAULT_MAX_INFERENCE_CALLS  # Forward + Generate at once (a stream holds one)
    reserved_workers: int = DEFAULT_RESERVED_WORKERS  # threads beyond both budgets: health, Describe, ListAdapters, reflection
    health_poll_s: float = 0.25
    stop_grace_s: float = 10.0  # how long stop() waits for running control and inference calls
    exit_linger_s: float = DEFAULT_EXIT_LINGER_S  # `serve`: Describe answers this long after the engine died

    @property
    def max_workers(self) -> int:
        """The server's thread pool: both budgets and the reserve."""
        return self.max_control_calls + self.max_inference_calls + self.reserved_workers


class AgentServer:
    """A bound gRPC server over one agent, with its health watcher and metrics endpoint."""

    def __init__(
        self,
        agent: Agent,
        server: grpc.Server,
        health_servicer: health.HealthServicer,
        port: int,
        options: ServerOptions,
        servicer: NodeAgentServicer,
    ) -> None:
        self.agent = agent
        self.server = server
        self.health = health_servicer
        self.port = port
        self.options = options
        self.servicer = servicer
        self.health_server: grpc.Server | None = None  # the health-only listener, if any
        self.health_port: int | None = None
        self._metrics: MetricsEndpoint | None = None
        self._done = threading.Event()
        self._stop_requested = threading.Event()
        self._engine_died = threading.Event()
        self._watcher: threading.Thread | None = None
        self._health_lock = threading.Lock()
        self._serving: bool | None = None
        self._stopping = False
        self.not_serving_reason = ""  # why health is NOT_SERVING ("" while SERVING)

    def start(self) -> None:
        """Serve. The metrics port is bound first: a port that cannot be bound (OSError) fails
        the start before health has said SERVING to anyone."""
        if self.options.metrics_port is not None:
            self._metrics = MetricsEndpoint(self.agent.metrics, self.options.metrics_port)
        self._set_health(self.agent.alive, "" if self.agent.alive else self.agent.failure())
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()
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
        # A stop requested before the watcher's next look must not hide a death: `serve` would
        # exit 0 and the pod would not restart.
        return self._engine_died.is_set() or not self.agent.alive

    def request_stop(self) -> None:
        """Make `wait()` (and `linger()`) return (safe from a signal handler: sets events, nothing else)."""
        self._stop_requested.set()
        self._done.set()

    def linger(self, seconds: float) -> None:
        """Keep serving (Describe answers, health says NOT_SERVING) for `seconds` or until
        `request_stop()`: after the engine died, so that an operator can see which rank."""
        self._stop_requested.wait(seconds)

    def stop(self, grace: float | None = None) -> None:
        """Stop serving: health NOT_SERVING and new control and inference calls refused
        (UNAVAILABLE) at once, running ones get `grace` seconds, then the server stops and
        cancels what is left. Describe, ListAdapters and health answer until then."""
        self._done.set()
        self._set_health(False, "the agent is shutting down", stopping=True)
        self.servicer.closing.set()
        deadline = time.monotonic() + (self.options.stop_grace_s if grace is None else grace)
        for budget in self.servicer.budgets.values():
            budget.wait_idle(deadline)
        self.health.enter_graceful_shutdown()
        # A call leaves its budget when its handler returns, before gRPC has sent the response:
        # what is left of the grace (at most RESPONSE_FLUSH_S) lets those responses go out
        # instead of being cancelled; stop() returns as soon as no call is left.
        flush = min(RESPONSE_FLUSH_S, max(0.0, deadline - time.monotonic()))
        self.server.stop(flush).wait()
        if self.health_server is not None:
            self.health_server.stop(0).wait()
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
                failure = self.agent.failure()
                log.error("engine is not serving (%s): health NOT_SERVING, calls fail with UNAVAILABLE", failure)
                self._set_health(False, failure)
                self._engine_died.set()
                self._done.set()
                return
            hang = self.agent.hang()
            if hang and self._serving:
                log.error("engine hangs: %s; health NOT_SERVING until the command completes", hang)
                self._set_health(False, hang)
            elif not hang and self._serving is False:
                log.warning("engine command completed: health SERVING again")
                self._set_health(True, "")

    def _set_health(self, serving: bool, reason: str, stopping: bool = False) -> None:
        with self._health_lock:
            if stopping:
                self._stopping = True
            elif self._stopping:
                return  # once stopping, health stays NOT_SERVING
            self._serving, self.not_serving_reason = serving, reason
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
    servicer = NodeAgentServicer(
        agent,
        control=CallBudget("control", options.max_control_calls, "--max-control-calls"),
        inference=CallBudget("inference", options.max_inference_calls, "--max-inference-calls"),
        token=options.auth_token,
        pod_name=options.pod_name,
    )
    agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
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
    agent_server = AgentServer(agent, server, health_servicer, port, options, servicer)
    if options.health_listen is not None:
        agent_server.health_server, agent_server.health_port = _health_only_server(health_servicer, options.health_listen)
    return agent_server


def _health_only_server(health_servicer: health.HealthServicer, listen: str) -> tuple[grpc.Server, int]:
    """A plaintext server answering grpc.health.v1 from the same servicer, and its bound port.
    Health carries no secret and changes nothing, so it needs neither TLS nor the token."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2, thread_name_prefix="lorafleet-health"), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as error:
        raise OSError(f"cannot listen on {listen} (--health-listen): {error}") from error
    if not port:
        raise OSError(f"cannot listen on {listen} (--health-listen)")
    return server, port
