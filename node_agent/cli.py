"""`lorafleet-agent`: the node agent's command line.

`serve` runs the node agent: an engine plus the `lorafleet.v1.NodeAgent` gRPC service.
`forward` starts an engine with the given topology, loads adapters, runs one batch and writes
the logits: how users and tests check what an adapter does on a sharded engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from node_agent.agent import DEFAULT_ENGINE_HANG_TIMEOUT_S, Agent, AgentConfig
from node_agent.auth import TlsFiles, read_token
from node_agent.engine import (
    MAX_LOGPROBS,
    AdapterLoadError,
    Engine,
    EngineConfig,
    EngineError,
    GeneratedStep,
    SamplingParams,
    SchedulerError,
    SequenceInput,
    TokenLogprobs,
    Topology,
)
from node_agent.errors import InvalidRequest
from node_agent.http_api import HttpApiServer, HttpOptions, split_listen
from node_agent.hub import DEFAULT_HUB_ENDPOINT
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
    DEFAULT_MAX_CONCURRENT_DOWNLOADS,
    SourcePolicy,
    SourcePrefix,
)
from node_agent.validation import check_adapter_name, check_forward
from node_agent.values import DEFAULT_NEW_TOKENS

log = logging.getLogger("lorafleet.agent")


class UsageError(ValueError):
    """Bad command-line input (reported as one line, exit code 2)."""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts an engine."""
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory (config.json + *.safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks in the engine (default 1)")
    parser.add_argument("--dp", type=int, default=1, help="DP-attention groups; must divide --tp (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel groups for MoE models; must divide --tp (default 1)")
    parser.add_argument("--fully-sharded-loras", action="store_true", help="S-LoRA mode: shard LoRA A/B on the rank dim too")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")
    parser.add_argument("--max-loras-per-batch", type=int, default=4, help="device LoRA slots per rank (default 4)")
    parser.add_argument("--max-loaded-loras", type=int, default=32, help="adapters kept loaded on the host (default 32)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where ranks run (default cpu, gloo)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="weights dtype (default: float32 on cpu, bfloat16 on cuda)"
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=0,
        help="the ranks' rendezvous port on 127.0.0.1, held by the agent while they run (default: one the kernel picks)",
    )
    parser.add_argument(
        "--engine-startup-timeout-s",
        type=float,
        default=EngineConfig.startup_timeout_s,
        metavar="S",
        help="how long the ranks may take to start and load the base model before the command fails "
        f"(default {EngineConfig.startup_timeout_s:g}; keep it under a pod's start-up probe)",
    )
    # Serving (docs/serving.md): the paged KV cache and the scheduler's limits.
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=EngineConfig.kv_cache_bytes,
        metavar="B",
        help=f"each rank's paged KV cache budget in bytes (default {EngineConfig.kv_cache_bytes >> 20} MiB)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="on cuda: size each rank's KV cache so the engine uses this fraction of the device's "
        "memory (what the model already holds comes off; replaces --kv-cache-bytes)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        metavar="N",
        help="torch threads of each cpu rank (default: the machine's cores / --tp; fewer on a busy machine)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        metavar="N",
        help=f"tokens per KV block (default {EngineConfig.block_size})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        metavar="S",
        help=f"sequences per step over all DP groups (default {EngineConfig.max_num_seqs})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        metavar="T",
        help=f"new tokens per step over all DP groups, at least --max-num-seqs (default {EngineConfig.max_num_batched_tokens})",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the KV of cached prompt prefixes (never across adapters or the base model)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if not args.engine_startup_timeout_s > 0:
        raise UsageError("--engine-startup-timeout-s must be positive")
    return EngineConfig(
        model_dir=args.model,
        topology=Topology(tp_size=args.tp, dp_size=args.dp, ep_size=args.ep, fully_sharded_loras=args.fully_sharded_loras),
        max_lora_rank=args.max_lora_rank,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        device=args.device,
        dtype=args.dtype,
        master_port=args.master_port,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_threads=args.cpu_threads,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=args.enable_prefix_caching,
        startup_timeout_s=args.engine_startup_timeout_s,
    )


def parse_adapter(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {value!r}")
    return name, Path(path)


def read_sequences(path: Path) -> list[SequenceInput]:
    """IN.json: a JSON list of {"tokens": [int, ...], "adapter": "NAME" or null}."""
    return [SequenceInput(tokens=item["tokens"], adapter=adapter) for item, adapter in read_input_items(path, "sequence")]


def read_input_items(path: Path, what: str) -> list[tuple[dict[str, Any], str | None]]:
    """The items of an IN.json list (`what`: "sequence" or "request"), each an object with a
    'tokens' list, with its 'adapter' (a name or null); every refusal names the item."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise UsageError(f"input file {path} not found") from error
    except json.JSONDecodeError as error:
        raise UsageError(f"input file {path} is not valid JSON: {error}") from error
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"input file {path} must hold a non-empty JSON list of {what}s")
    items = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("tokens"), list):
            raise UsageError(f"input {what} {index} must be an object with a 'tokens' list")
        adapter = item.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise UsageError(f"input {what} {index}: 'adapter' must be a name or null")
        items.append((item, adapter))
    return items


def adapter_names(args: argparse.Namespace) -> list[str]:
    """The --adapter names, each given once and each a valid adapter name."""
    names = [name for name, _ in args.adapter]
    if len(set(names)) != len(names):
        raise UsageError("each --adapter NAME may be given once")
    for name in names:
        check_adapter_name(name)
    return names


def run_forward(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    sequences = read_sequences(args.input)
    adapter_names(args)  # refused before any rank starts
    with Engine(engine_config(args)) as engine:
        # The agent's own checks of a Forward: the engine trusts what it is given.
        check_forward([s.tokens for s in sequences], engine.model_config.vocab_size)
        for name, path in args.adapter:
            log.info("loading adapter %s from %s", name, path)
            engine.load_adapter(name, path)
        logits = engine.forward(sequences)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"logits.{i}": t.contiguous() for i, t in enumerate(logits)}, str(args.output))
    log.info("wrote %d logits tensors to %s", len(logits), args.output)


_REQUEST_FIELDS = {"tokens", "adapter", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "logprobs"}


def read_generate_requests(path: Path, logprobs: int | None = None) -> list[tuple[list[int], str | None, SamplingParams]]:
    """IN.json of `generate`: a JSON list of {"tokens": [...], "adapter": NAME or null,
    "max_tokens": N, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": null,
    "stop_token_ids": [], "logprobs": N or null} (only "tokens" required; a request without
    "logprobs" takes `logprobs`, the --logprobs flag)."""
    requests = []
    for index, (item, adapter) in enumerate(read_input_items(path, "request")):
        unknown = sorted(set(item) - _REQUEST_FIELDS)
        if unknown:
            raise UsageError(f"input request {index}: unknown field {unknown[0]!r}")
        stop = item.get("stop_token_ids", [])
        if not isinstance(stop, list):
            raise UsageError(f"input request {index}: 'stop_token_ids' must be a list of token ids")
        try:
            params = SamplingParams(
                temperature=item.get("temperature", 0.0),
                top_p=item.get("top_p", 1.0),
                top_k=item.get("top_k", 0),
                min_p=item.get("min_p", 0.0),
                seed=item.get("seed"),
                max_tokens=item.get("max_tokens", DEFAULT_NEW_TOKENS),
                stop_token_ids=tuple(stop),
                logprobs=item.get("logprobs", logprobs),
            )
        except (TypeError, ValueError) as error:
            raise UsageError(f"input request {index}: {error}") from error
        requests.append((item["tokens"], adapter, params))
    return requests


def generation_output(steps: list[GeneratedStep]) -> dict[str, Any]:
    """One OUT.json entry: the generated ids and the finish reason, and, when the request asked
    for logprobs, one entry per token as OpenAI's chat API lays them out (token ids, not text)."""
    finish = steps[-1].finish
    out: dict[str, Any] = {"tokens": [step.token_id for step in steps], "finish_reason": finish.value if finish else None}
    if steps[0].logprobs is not None:
        out["logprobs"] = [token_logprobs(step.token_id, step.logprobs) for step in steps if step.logprobs is not None]
    return out


def token_logprobs(token_id: int, logprobs: TokenLogprobs) -> dict[str, Any]:
    """{"token": id, "logprob": x, "top_logprobs": [{"token": id, "logprob": x}, ...]}, highest first."""
    top = [{"token": t, "logprob": lp} for t, lp in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)]
    return {"token": token_id, "logprob": logprobs.logprob, "top_logprobs": top}


def run_generate(args: argparse.Namespace) -> None:
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise UsageError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {args.logprobs}")
    requests = read_generate_requests(args.input, args.logprobs)
    names = adapter_names(args)
    unknown = sorted({adapter for _, adapter, _ in requests if adapter is not None} - set(names))
    if unknown:
        raise UsageError(f"an input request names adapter {unknown[0]!r}, which no --adapter gives")
    config = dataclasses.replace(engine_config(args), max_waiting=max(EngineConfig.max_waiting, len(requests)))
    with Engine(config) as engine:
        check_forward([tokens for tokens, _, _ in requests], engine.model_config.vocab_size)
        for name, path in args.adapter:
            log.info("loading adapter %s from %s", name, path)
            engine.load_adapter(name, path)
        # Every request at once: the scheduler batches them.
        generations = [engine.submit(tokens, adapter, params) for tokens, adapter, params in requests]
        results = [generation_output(list(generation.tokens())) for generation in generations]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results) + "\n")
    log.info("wrote %d generations to %s", len(results), args.output)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's own flags (the engine's come from add_engine_arguments)."""
    parser.add_argument(
        "--listen", default="0.0.0.0:50051", metavar="HOST:PORT", help="gRPC address; port 0 picks a free one (default 0.0.0.0:50051)"
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


def run_serve(args: argparse.Namespace) -> None:
    options = server_options(args)
    http = http_options(args, options)
    config = agent_config(args)
    with Agent.start(engine_config(args), config) as agent:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet-agent", description="lorafleet node agent: sharded multi-LoRA engine")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    commands = parser.add_subparsers(dest="command", required=True)
    forward = commands.add_parser(
        "forward",
        help="run one batch through a sharded engine and write the logits",
        description="Start an engine with the given topology on this machine, load the adapters, run one "
        "forward over all input sequences together (spread over the DP groups) and write float32 "
        "tensors logits.0, logits.1, ... of shape [len(tokens), vocab_size] to OUT.safetensors.",
    )
    add_engine_arguments(forward)
    forward.add_argument(
        "--adapter",
        action="append",
        default=[],
        type=parse_adapter,
        metavar="NAME=DIR",
        help="a PEFT adapter directory to load under NAME (repeatable)",
    )
    forward.add_argument(
        "--input", required=True, type=Path, metavar="IN.json", help='JSON list of {"tokens": [int, ...], "adapter": "NAME" or null}'
    )
    forward.add_argument("--output", required=True, type=Path, metavar="OUT.safetensors", help="where to write the logits")
    forward.set_defaults(run=run_forward)
    generate = commands.add_parser(
        "generate",
        help="generate for a batch of requests through the engine's scheduler and write the tokens",
        description="Start an engine with the given topology on this machine, load the adapters, submit every "
        "input request at once to the scheduler (continuous batching over the DP groups) and write, in input "
        'order, [{"tokens": [generated ids], "finish_reason": "stop" | "length"}, ...] to OUT.json. Only the '
        "request's own stop_token_ids stop it (the model's EOS is not added). A request with logprobs N also gets "
        '"logprobs": one {"token": id, "logprob": x, "top_logprobs": [{"token": id, "logprob": x}, ...]} per generated '
        "token: the log-softmax of the model's logits before temperature and filtering, the N most likely tokens "
        "highest first (lower id first on ties).",
    )
    add_engine_arguments(generate)
    generate.add_argument(
        "--adapter",
        action="append",
        default=[],
        type=parse_adapter,
        metavar="NAME=DIR",
        help="a PEFT adapter directory to load under NAME (repeatable)",
    )
    generate.add_argument(
        "--input",
        required=True,
        type=Path,
        metavar="IN.json",
        help='JSON list of {"tokens": [...], "adapter": NAME or null, "max_tokens": N, "temperature": 0.0, '
        '"top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": null, "stop_token_ids": [], "logprobs": null} '
        "(only tokens required)",
    )
    generate.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help=f"per generated token, its logprob and the N (0-{MAX_LOGPROBS}) most likely tokens' in OUT.json, "
        'for every request without its own "logprobs" (default: none)',
    )
    generate.add_argument("--output", required=True, type=Path, metavar="OUT.json", help="where to write the generations")
    generate.set_defaults(run=run_generate)
    serve = commands.add_parser(
        "serve",
        help="run the node agent: an engine and the lorafleet.v1.NodeAgent gRPC service",
        description="Start an engine with the given topology and serve lorafleet.v1.NodeAgent, "
        "grpc.health.v1.Health and reflection. Exits non-zero when a rank dies (see docs/agent.md).",
    )
    add_engine_arguments(serve)
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        args.run(args)
    except (UsageError, InvalidRequest, EngineError, SchedulerError, AdapterLoadError, ValueError, OSError) as error:
        print(f"lorafleet-agent: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
