"""The node agent's gRPC server: `lorafleet.v1.NodeAgent`, health, reflection, auth, TLS.

The servicer is thin (message -> `Agent` call -> message: `servicer`); `AgentError`s become
status codes in one table, `status.STATUS_CODES`. `create_server()` builds and binds a server
without starting it; `AgentServer.start()` / `wait()` / `stop()` run it, so tests and the CLI
share one path (`agent_server`).

Budgets: health, Describe and ListAdapters never queue behind control or inference calls. The
thread pool has room for `max_control_calls` control calls (LoadAdapter, LoadAdapters, UnloadAdapter),
`max_inference_calls` inference calls (Forward, Generate streams), the inference calls waiting
in their queue, and `reserved_workers` more for everything else; a control call beyond its budget,
or an inference call beyond the queue, is refused at once with RESOURCE_EXHAUSTED (`TooManyCalls`,
`budgets`), so neither class can take the others' threads.

Health: SERVING while every rank is alive and no engine command has run longer than the agent's
`engine_hang_timeout_s` (a hung engine is NOT_SERVING until the command completes). A watcher
polls the engine; when a rank dies it turns health NOT_SERVING and ends `wait()`, after which
`lorafleet-agent serve` keeps answering Describe for `exit_linger_s`, then exits non-zero so
Kubernetes restarts the pod. Calls fail fast with UNAVAILABLE from then on.
"""

from node_agent.server.agent_server import (
    DEFAULT_EXIT_LINGER_S,
    DEFAULT_INFERENCE_QUEUE_WAIT_S,
    DEFAULT_MAX_CONTROL_CALLS,
    DEFAULT_MAX_INFERENCE_CALLS,
    DEFAULT_RESERVED_WORKERS,
    INFERENCE_QUEUE_FACTOR,
    AgentServer,
    ServerOptions,
    create_server,
)
from node_agent.server.budgets import CallBudget, QueueRule
from node_agent.server.servicer import MAX_LOADS_PER_CALL, NodeAgentServicer
from node_agent.server.status import STATUS_CODES, status_code

__all__ = [
    "DEFAULT_EXIT_LINGER_S",
    "DEFAULT_INFERENCE_QUEUE_WAIT_S",
    "DEFAULT_MAX_CONTROL_CALLS",
    "DEFAULT_MAX_INFERENCE_CALLS",
    "DEFAULT_RESERVED_WORKERS",
    "INFERENCE_QUEUE_FACTOR",
    "MAX_LOADS_PER_CALL",
    "STATUS_CODES",
    "AgentServer",
    "CallBudget",
    "NodeAgentServicer",
    "QueueRule",
    "ServerOptions",
    "create_server",
    "status_code",
]
