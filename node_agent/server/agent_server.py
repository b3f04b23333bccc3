"""The gRPC server over one agent: `create_server()` builds and binds it without starting it;
`AgentServer.start()` / `wait()` / `stop()` run it, so tests and the CLI share one path.

Its thread pool has room for both call budgets, the inference calls waiting in their queue (each
holds a thread) and `reserved_workers` more, so health, Describe and ListAdapters never queue
behind control or inference calls. Its health watcher polls the
engine: a hung command makes health NOT_SERVING until it completes, a dead rank for good (and
ends `wait()`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lorafleet.v1 import agent_pb2 as pb
from lorafleet.v1 import agent_pb2_grpc
from node_agent.agent import Agent
from node_agent.auth import BearerTokenInterceptor, TlsFiles
from node_agent.metrics import MetricsEndpoint
from node_agent.server.budgets import CallBudget, QueueRule
from node_agent.server.servicer import NodeAgentServicer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["NodeAgent"].full_name
HEALTH_SERVICE_NAME = health.SERVICE_NAME
# Health is reported for the whole server ("") and for the NodeAgent service.
HEALTH_SERVICES = ("", SERVICE_NAME)

DEFAULT_MAX_CONTROL_CALLS = 16
DEFAULT_MAX_INFERENCE_CALLS = 32
DEFAULT_RESERVED_WORKERS = 8
INFERENCE_QUEUE_FACTOR = 4  # the inference queue's default length: this many times the budget
DEFAULT_INFERENCE_QUEUE_WAIT_S = 30.0
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
    # Inference calls that may wait for a place (None: INFERENCE_QUEUE_FACTOR x max_inference_calls),
    # each at most this long (or its own deadline, if sooner).
    max_queued_inference_calls: int | None = None
    inference_queue_wait_s: float = DEFAULT_INFERENCE_QUEUE_WAIT_S
    reserved_workers: int = DEFAULT_RESERVED_WORKERS  # threads beyond both budgets: health, Describe, ListAdapters, reflection
    health_poll_s: float = 0.25
    stop_grace_s: float = 10.0  # how long stop() waits for running control and inference calls
    exit_linger_s: float = DEFAULT_EXIT_LINGER_S  # `serve`: Describe answers this long after the engine died

    @property
    def inference_queue(self) -> QueueRule:
        """The inference budget's queue: its length and wait, and the flags that set them."""
        size = self.max_queued_inference_calls
        return QueueRule(
            INFERENCE_QUEUE_FACTOR * self.max_inference_calls if size is None else size,
            self.inference_queue_wait_s,
            "--max-queued-inference-calls",
            "--inference-queue-wait-s",
        )

    @property
    def max_workers(self) -> int:
        """The server's thread pool: both budgets, the inference queue (a waiting call holds its
        thread) and the reserve."""
        return self.max_control_calls + self.max_inference_calls + self.inference_queue.size + self.reserved_workers


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
            budget.close()  # the queued calls are refused too
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
        inference=CallBudget("inference", options.max_inference_calls, "--max-inference-calls", options.inference_queue),
        token=options.auth_token,
        pod_name=options.pod_name,
    )
    for name, budget in servicer.budgets.items():
        agent.metrics.watch_budget(name, budget)
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
