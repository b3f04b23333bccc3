"""`lorafleet-agent serve`: the node agent, an engine behind the `lorafleet.v1.NodeAgent` gRPC
service and, with --http-listen, the OpenAI-compatible HTTP API.

The serve flags become the server's, the agent's and the HTTP API's settings here (a bad flag or
file is a usage error before any rank starts); `run_serve` runs them until a signal or a rank's
death, which exits non-zero so Kubernetes restarts the pod.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
from pathlib import Path

from node_agent.agent import DEFAULT_ENGINE_HANG_TIMEOUT_S, Agent, AgentConfig
from node_agent.auth import TlsFiles, read_token
from node_agent.backend import Capacity
from node_agent.backends.vllm import vllm_backend
from node_agent.cli.engine_flags import UsageError, add_engine_arguments, engine_config
from node_agent.engine import EngineError
from node_agent.http_api import HttpApiServer, HttpOptions, split_listen
from node_agent.server import (
    DEFAULT_EXIT_LINGER_S,
    DEFAULT_MAX_CONTROL_CALLS,
    DEFAULT_MAX_INFERENCE_CALLS,
    DEFAULT_RESERVED_WORKERS,
    AgentServer,
    ServerOptions,
    create_server,
)
from node_agent.sources import (
    DEFAULT_DOWNLOAD_MIN_BYTES_PER_S,
    DEFAULT_DOWNLOAD_RATE_WINDOW_S,
    DEFAULT_DOWNLOAD_TIMEOUT_S,
    DEFAULT_HUB_ENDPOINT,
    DEFAULT_MAX_CONCURRENT_DOWNLOADS,
    SourcePolicy,
    SourcePrefix,
)

log = logging.getLogger("lorafleet.agent")


def add_serve_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `serve` command: the engine's flags, then the agent's own."""
    serve = commands.add_parser(
        "serve",
        help="run the node agent: an engine and the lorafleet.v1.NodeAgent gRPC service",
        description="Start an engine with the given topology and serve lorafleet.v1.NodeAgent, "
        "grpc.health.v1.Health and reflection. Exits non-zero when a rank dies (see docs/agent.md).",
    )
    add_engine_arguments(serve)
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's own flags (the engine's come from add_engine_arguments)."""
    parser.add_argument(
        "--listen", default="0.0.0.0:50051", metavar="HOST:PORT", help="gRPC address; port 0 picks a free one (default 0.0.0.0:50051)"
    )
    parser.add_argument(
        "--backend",
        choices=("builtin", "vllm"),
        default="builtin",
        help="what serves the adapters: builtin, the agent's own engine; vllm, the stock vLLM servers "
        "named by --vllm-endpoint, driven over HTTP (docs/vllm.md) (default builtin)",
    )
    parser.add_argument(
        "--vllm-endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="with --backend vllm: a vLLM OpenAI server, http://HOST:PORT, one rank each (repeatable, "
        "in rank order); its --max-lora-rank, --max-loras and --max-cpu-loras are this agent's "
        "--max-lora-rank, --max-loras-per-batch and --max-loaded-loras",
    )
    parser.add_argument(
        "--http-listen",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API here (docs/http-api.md), with the same token "
        "and TLS files as gRPC; port 0 picks a free one (default: off)",
    )
    parser.add_argument(
        "--base-model-name", metavar="NAME", help="base model name reported by Describe (default: the --model directory's name)"
    )
    parser.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="directory file:// adapter sources must lie under (repeatable; none: file:// refused)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, metavar="DIR", help="where http(s) adapter sources are downloaded (none: http(s) refused)"
    )
    parser.add_argument(
        "--auth-token-file", type=Path, metavar="FILE", help="require 'authorization: Bearer <token>' on every call but health"
    )
    parser.add_argument(
        "--pod-name",
        metavar="NAMESPACE/NAME",
        help="this agent's pod: identity challenges (ProveIdentity) for another pod are not answered, so a "
        "pod cannot relay them here (the chart sets it from the downward API; default: any pod)",
    )
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve TLS with this PEM certificate chain")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="the PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", type=Path, metavar="FILE", help="mutual TLS: require client certificates issued by this PEM CA")
    parser.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics over HTTP on this port")
    parser.add_argument(
        "--health-listen",
        metavar="HOST:PORT",
        help="also serve grpc.health.v1 alone, in plaintext and without the token, here: for "
        "kubelet's gRPC probes when --tls-cert is set (default: off)",
    )
    parser.add_argument(
        "--download-timeout-s",
        type=float,
        default=DEFAULT_DOWNLOAD_TIMEOUT_S,
        metavar="S",
        help=f"overall deadline of one http(s) source's download (default {DEFAULT_DOWNLOAD_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--download-min-bytes-per-s",
        type=int,
        default=DEFAULT_DOWNLOAD_MIN_BYTES_PER_S,
        metavar="B",
        help="fail a download that receives fewer bytes per second over "
        f"{DEFAULT_DOWNLOAD_RATE_WINDOW_S:g} s; 0: no minimum (default {DEFAULT_DOWNLOAD_MIN_BYTES_PER_S})",
    )
    parser.add_argument(
        "--max-concurrent-downloads",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_DOWNLOADS,
        metavar="N",
        help=f"downloads at once; more are refused with RESOURCE_EXHAUSTED (default {DEFAULT_MAX_CONCURRENT_DOWNLOADS})",
    )
    parser.add_argument(
        "--allow-source",
        action="append",
        default=[],
        metavar="PREFIX",
        help="an http(s) URL prefix adapters may be downloaded from, e.g. https://huggingface.co/ "
        "(repeatable; every redirect hop must match one too; none: http(s) sources refused)",
    )
    parser.add_argument(
        "--hub-endpoint",
        default=DEFAULT_HUB_ENDPOINT,
        metavar="URL",
        help="where hf:// sources are fetched from: the Hugging Face Hub or a mirror; it must lie under "
        f"an --allow-source prefix too (default {DEFAULT_HUB_ENDPOINT})",
    )
    parser.add_argument(
        "--allow-source-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="a loopback, link-local or private network downloads may connect to (repeatable; "
        "default none: such addresses are refused, every DNS answer and redirect checked)",
    )
    parser.add_argument(
        "--max-control-calls",
        type=int,
        default=DEFAULT_MAX_CONTROL_CALLS,
        metavar="N",
        help=f"LoadAdapter/UnloadAdapter calls at once; more are refused with RESOURCE_EXHAUSTED (default {DEFAULT_MAX_CONTROL_CALLS})",
    )
    parser.add_argument(
        "--max-inference-calls",
        type=int,
        default=DEFAULT_MAX_INFERENCE_CALLS,
        metavar="N",
        help="Forward calls and Generate streams at once; more are refused with RESOURCE_EXHAUSTED "
        f"(default {DEFAULT_MAX_INFERENCE_CALLS})",
    )
    parser.add_argument(
        "--reserved-workers",
        type=int,
        default=DEFAULT_RESERVED_WORKERS,
        metavar="N",
        help=f"gRPC threads beyond both budgets, for health, Describe, ListAdapters and reflection (default {DEFAULT_RESERVED_WORKERS})",
    )
    parser.add_argument(
        "--engine-hang-timeout-s",
        type=float,
        default=DEFAULT_ENGINE_HANG_TIMEOUT_S,
        metavar="S",
        help=f"an engine command running longer makes health NOT_SERVING until it completes (default {DEFAULT_ENGINE_HANG_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--exit-linger-s",
        type=float,
        default=DEFAULT_EXIT_LINGER_S,
        metavar="S",
        help=f"after a rank died, keep answering Describe this long before exiting (default {DEFAULT_EXIT_LINGER_S:g})",
    )


def server_options(args: argparse.Namespace) -> ServerOptions:
    """Read the auth and TLS files named by the flags; a bad file is a usage error."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    for path in (args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file):
        if path is not None and not path.is_file():
            raise UsageError(f"{path} is not a readable file")
    try:
        token = read_token(args.auth_token_file) if args.auth_token_file else None
    except ValueError as error:
        raise UsageError(str(error)) from error
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    for flag, value in (
        ("--max-control-calls", args.max_control_calls),
        ("--max-inference-calls", args.max_inference_calls),
        ("--reserved-workers", args.reserved_workers),
    ):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1")
    if args.exit_linger_s < 0:
        raise UsageError("--exit-linger-s must be 0 or more")
    return ServerOptions(
        listen=args.listen,
        auth_token=token,
        tls=tls,
        metrics_port=args.metrics_port,
        health_listen=args.health_listen,
        pod_name=args.pod_name,
        max_control_calls=args.max_control_calls,
        max_inference_calls=args.max_inference_calls,
        reserved_workers=args.reserved_workers,
        exit_linger_s=args.exit_linger_s,
    )


def agent_config(args: argparse.Namespace) -> AgentConfig:
    """The agent's settings and source policy from the flags; a bad value is a usage error."""
    for root in args.adapter_root:
        if not root.is_dir():
            raise UsageError(f"--adapter-root {root} is not a directory")
    if not args.download_timeout_s > 0:
        raise UsageError("--download-timeout-s must be positive")
    if args.download_min_bytes_per_s < 0:
        raise UsageError("--download-min-bytes-per-s must be 0 or more")
    if args.max_concurrent_downloads < 1:
        raise UsageError("--max-concurrent-downloads must be at least 1")
    for entry in args.allow_source:
        try:
            SourcePrefix.parse(entry)
        except ValueError as error:
            raise UsageError(str(error)) from None
    for entry in args.allow_source_network:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise UsageError(f"--allow-source-network {entry!r} is not an IP network (CIDR, e.g. 10.0.0.0/8)") from None
    if not args.engine_hang_timeout_s > 0:
        raise UsageError("--engine-hang-timeout-s must be positive")
    sources = SourcePolicy(
        adapter_roots=tuple(args.adapter_root),
        cache_dir=args.cache_dir,
        download_timeout_s=args.download_timeout_s,
        download_min_bytes_per_s=args.download_min_bytes_per_s,
        max_concurrent_downloads=args.max_concurrent_downloads,
        allowed_sources=tuple(args.allow_source),
        allowed_networks=tuple(args.allow_source_network),
        hub_endpoint=args.hub_endpoint,
    )
    return AgentConfig(base_model_name=args.base_model_name or "", sources=sources, engine_hang_timeout_s=args.engine_hang_timeout_s)


def http_options(args: argparse.Namespace, options: ServerOptions) -> HttpOptions | None:
    """The HTTP API's settings (None: --http-listen not given): gRPC's token and TLS files."""
    if args.http_listen is None:
        return None
    try:
        split_listen(args.http_listen)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return HttpOptions(listen=args.http_listen, auth_token=options.auth_token, tls=options.tls, stop_grace_s=options.stop_grace_s)


def start_servers(agent: Agent, options: ServerOptions, http: HttpOptions | None) -> tuple[AgentServer, HttpApiServer | None]:
    """The agent's gRPC server and, with `http`, its HTTP API, serving. Every listener is bound
    before gRPC serves: a port that is taken (OSError) fails the start before health has said
    SERVING to any probe (the process then exits: `run_serve`)."""
    server = create_server(agent, options)
    http_server = None
    try:
        if http is not None:
            # The same inference budget and shutdown flag as gRPC: one limit, one stop.
            api = HttpApiServer(agent, http, server.servicer.budgets["inference"], server.servicer.closing)
            api.start()
            http_server = api
        server.start()
    except BaseException:
        if http_server is not None:
            http_server.stop()
        server.stop(grace=0)
        raise
    return server, http_server


def start_agent(args: argparse.Namespace, config: AgentConfig) -> Agent:
    """The agent over the backend --backend names: the builtin engine, or vLLM servers."""
    if args.backend == "builtin":
        return Agent.start(engine_config(args), config)
    if not args.vllm_endpoint:
        raise UsageError("--backend vllm needs at least one --vllm-endpoint")
    if args.cache_dir is None:
        raise UsageError("--backend vllm needs --cache-dir on the volume the vLLM servers read adapters from")
    capacity = Capacity(args.max_lora_rank, args.max_loras_per_batch, args.max_loaded_loras)
    try:
        backend = vllm_backend(args.vllm_endpoint, args.model, capacity)
    except ValueError as error:
        raise UsageError(str(error)) from None
    log.info("driving the vLLM servers %s", ", ".join(backend.servers))
    try:
        return Agent(backend, config)
    except BaseException:
        backend.close()
        raise


def run_serve(args: argparse.Namespace) -> None:
    """`serve`: start the agent and its servers, serve until a signal or a rank's death."""
    options = server_options(args)
    http = http_options(args, options)
    config = agent_config(args)
    with start_agent(args, config) as agent:
        server, http_server = start_servers(agent, options, http)
        log.info("serving lorafleet.v1.NodeAgent on %s (port %d)", args.listen, server.port)
        if server.health_port is not None:
            log.info("serving grpc.health.v1 alone, in plaintext, on %s (port %d)", args.health_listen, server.health_port)
        if http_server is not None:
            log.info("serving the OpenAI-compatible HTTP API on %s (port %d)", http_server.options.listen, http_server.port)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: server.request_stop())
        died = server.wait()
        if died:
            server.linger(options.exit_linger_s)  # Describe shows which rank died; SIGTERM cuts it short
        server.stop()  # refuses new inference on both APIs at once, lets running calls finish
        if http_server is not None:
            http_server.stop()
        if died:
            # Exit non-zero so Kubernetes restarts the pod: a rank cannot be restarted alone.
            raise EngineError(f"engine is not serving ({agent.failure()}); exiting so the pod restarts")
    log.info("stopped")
