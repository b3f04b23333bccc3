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
import os
import signal
from collections.abc import Mapping

from node_agent.agent import Agent, AgentConfig
from node_agent.auth import TlsFiles, read_token
from node_agent.backend import Capacity
from node_agent.backends.vllm import vllm_backend
from node_agent.cli.engine_flags import UsageError, add_engine_arguments, engine_config
from node_agent.cli.serve_flags import add_serve_arguments, add_storage_source_arguments
from node_agent.engine import EngineError
from node_agent.http_api import HttpApiServer, HttpOptions, split_listen
from node_agent.residency import OnDemandSettings
from node_agent.server import (
    AgentServer,
    ServerOptions,
    create_server,
)
from node_agent.sources import (
    S3Credential,
    SourcePolicy,
    WebIdentity,
    WebIdentityCredentials,
    default_sts_endpoint,
    parse_allow_entry,
)
from node_agent.standby_memory import MIB, StandbyMemorySettings

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
    add_storage_source_arguments(serve)
    serve.set_defaults(run=run_serve)


def s3_credential_from_environment(environ: Mapping[str, str]) -> S3Credential | None:
    """The agent's own S3 credential from the standard AWS variables (None when unset); a key
    without its secret is a usage error."""
    key, secret = environ.get("AWS_ACCESS_KEY_ID", ""), environ.get("AWS_SECRET_ACCESS_KEY", "")
    if not key and not secret:
        return None
    if not key or not secret:
        raise UsageError("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together")
    return S3Credential(key, secret, environ.get("AWS_SESSION_TOKEN", ""))


def s3_web_identity(args: argparse.Namespace, environ: Mapping[str, str]) -> WebIdentityCredentials | None:
    """The pod's web identity when --s3-web-identity asks for it (docs/sources-s3.md); a usage
    error without a store, beside the agent's own keys, or without the pod's variables."""
    if not args.s3_web_identity:
        if args.s3_sts_endpoint:
            raise UsageError("--s3-sts-endpoint is only used with --s3-web-identity")
        return None
    if not args.s3_endpoint:
        raise UsageError("--s3-web-identity needs --s3-endpoint")
    if environ.get("AWS_ACCESS_KEY_ID"):
        raise UsageError("--s3-web-identity and AWS_ACCESS_KEY_ID are two credentials for the agent: give one")
    networks = tuple(ipaddress.ip_network(entry, strict=False) for entry in args.allow_source_network)
    try:
        identity = WebIdentity.from_environment(environ, args.s3_sts_endpoint or default_sts_endpoint(args.s3_region), networks)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return WebIdentityCredentials(identity)


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
    if args.max_queued_inference_calls is not None and args.max_queued_inference_calls < 0:
        raise UsageError("--max-queued-inference-calls must be 0 or more")
    if not args.inference_queue_wait_s > 0:
        raise UsageError("--inference-queue-wait-s must be positive")
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
        max_queued_inference_calls=args.max_queued_inference_calls,
        inference_queue_wait_s=args.inference_queue_wait_s,
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
            parse_allow_entry(entry)
        except ValueError as error:
            raise UsageError(str(error)) from None
    for entry in args.allow_source_network:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise UsageError(f"--allow-source-network {entry!r} is not an IP network (CIDR, e.g. 10.0.0.0/8)") from None
    if not args.engine_hang_timeout_s > 0:
        raise UsageError("--engine-hang-timeout-s must be positive")
    try:
        sources = SourcePolicy(
            adapter_roots=tuple(args.adapter_root),
            cache_dir=args.cache_dir,
            download_timeout_s=args.download_timeout_s,
            download_min_bytes_per_s=args.download_min_bytes_per_s,
            max_concurrent_downloads=args.max_concurrent_downloads,
            allowed_sources=tuple(args.allow_source),
            allowed_networks=tuple(args.allow_source_network),
            hub_endpoint=args.hub_endpoint,
            s3_endpoint=args.s3_endpoint,
            s3_region=args.s3_region,
            s3_credential=s3_credential_from_environment(os.environ) if args.s3_endpoint else None,
            s3_web_identity=s3_web_identity(args, os.environ),
            oci_plain_http=tuple(entry.lower() for entry in args.oci_plain_http),
        )
    except ValueError as error:  # --s3-endpoint
        raise UsageError(str(error)) from None
    return AgentConfig(
        base_model_name=args.base_model_name or "",
        sources=sources,
        engine_hang_timeout_s=args.engine_hang_timeout_s,
        on_demand=on_demand_settings(args),
    )


def on_demand_settings(args: argparse.Namespace) -> OnDemandSettings:
    """How standby adapters are loaded on first request, from the flags."""
    if args.max_concurrent_adapter_loads < 1:
        raise UsageError("--max-concurrent-adapter-loads must be at least 1")
    if not args.adapter_load_deadline_s > 0:
        raise UsageError("--adapter-load-deadline-s must be positive")
    return OnDemandSettings(args.max_concurrent_adapter_loads, args.adapter_load_deadline_s, standby_memory_settings(args))


def standby_memory_settings(args: argparse.Namespace) -> StandbyMemorySettings:
    """The host-memory tier of standby snapshots, from the flags; its directory must be usable."""
    if args.standby_memory_mib < 0:
        raise UsageError("--standby-memory-mib must be 0 (off) or more")
    settings = StandbyMemorySettings(args.standby_memory_mib * MIB, args.standby_memory_dir)
    if settings.enabled:
        try:
            settings.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--standby-memory-dir {settings.directory} is not usable: {error.strerror or error}") from None
        if not os.access(settings.directory, os.W_OK | os.X_OK):
            raise UsageError(f"--standby-memory-dir {settings.directory} is not a directory this agent can write")
    return settings


def http_options(args: argparse.Namespace, options: ServerOptions) -> HttpOptions | None:
    """The HTTP API's settings (None: --http-listen not given): gRPC's token and TLS files."""
    if args.http_listen is None:
        return None
    try:
        split_listen(args.http_listen)
        return HttpOptions(
            listen=args.http_listen,
            auth_token=options.auth_token,
            tls=options.tls,
            stop_grace_s=options.stop_grace_s,
            header_timeout_s=args.http_header_timeout_s,
            body_timeout_s=args.http_body_timeout_s,
            idle_timeout_s=args.http_idle_timeout_s,
            max_connections=args.http_max_connections,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


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
