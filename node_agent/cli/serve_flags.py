"""The `serve` command's own flags (the engine's are `engine_flags`'): addresses and the backend,
the HTTP API's limits, auth and TLS, sources and downloads, call budgets and the inference
queue, on-demand loads, health. `serve` turns them into settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from node_agent.agent import DEFAULT_ENGINE_HANG_TIMEOUT_S
from node_agent.http_api import HttpOptions
from node_agent.residency import DEFAULT_LOAD_DEADLINE_S, DEFAULT_MAX_CONCURRENT_LOADS
from node_agent.server import (
    DEFAULT_EXIT_LINGER_S,
    DEFAULT_INFERENCE_QUEUE_WAIT_S,
    DEFAULT_MAX_CONTROL_CALLS,
    DEFAULT_MAX_INFERENCE_CALLS,
    DEFAULT_RESERVED_WORKERS,
    INFERENCE_QUEUE_FACTOR,
)
from node_agent.sources import (
    DEFAULT_DOWNLOAD_MIN_BYTES_PER_S,
    DEFAULT_DOWNLOAD_RATE_WINDOW_S,
    DEFAULT_DOWNLOAD_TIMEOUT_S,
    DEFAULT_HUB_ENDPOINT,
    DEFAULT_MAX_CONCURRENT_DOWNLOADS,
    DEFAULT_S3_REGION,
)
from node_agent.standby_memory import DEFAULT_DIRECTORY as DEFAULT_STANDBY_MEMORY_DIR


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
        "--http-header-timeout-s",
        type=float,
        default=HttpOptions.header_timeout_s,
        metavar="S",
        help="seconds an HTTP request's headers (and a TLS handshake) may take from their first byte; "
        f"a slower client is disconnected (default {HttpOptions.header_timeout_s:g})",
    )
    parser.add_argument(
        "--http-body-timeout-s",
        type=float,
        default=HttpOptions.body_timeout_s,
        metavar="S",
        help="seconds an HTTP request's body may take after its headers; a slower client is disconnected "
        f"(default {HttpOptions.body_timeout_s:g})",
    )
    parser.add_argument(
        "--http-idle-timeout-s",
        type=float,
        default=HttpOptions.idle_timeout_s,
        metavar="S",
        help=f"seconds an HTTP keep-alive connection stays open with no request in flight (default {HttpOptions.idle_timeout_s:g})",
    )
    parser.add_argument(
        "--http-max-connections",
        type=int,
        default=HttpOptions.max_connections,
        metavar="N",
        help=f"HTTP connections open at once; beyond, a new one is answered 503 and closed (default {HttpOptions.max_connections})",
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
        "(repeatable; every redirect hop must match one too; none: http(s) sources refused), or an "
        "s3://BUCKET[/KEY-PREFIX] or oci://REGISTRY[/REPOSITORY-PREFIX] prefix",
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
        help=f"Forward calls and Generate streams at once; more wait in the inference queue (default {DEFAULT_MAX_INFERENCE_CALLS})",
    )
    parser.add_argument(
        "--max-queued-inference-calls",
        type=int,
        metavar="N",
        help="inference calls that may wait for a place (first come, first served); more are refused with "
        f"RESOURCE_EXHAUSTED (default {INFERENCE_QUEUE_FACTOR} x --max-inference-calls)",
    )
    parser.add_argument(
        "--inference-queue-wait-s",
        type=float,
        default=DEFAULT_INFERENCE_QUEUE_WAIT_S,
        metavar="S",
        help="the longest a queued inference call waits for a place (or its own deadline, if sooner), then "
        f"RESOURCE_EXHAUSTED (default {DEFAULT_INFERENCE_QUEUE_WAIT_S:g})",
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
        "--max-concurrent-adapter-loads",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_LOADS,
        metavar="N",
        help=f"standby adapters loaded on first request at once (default {DEFAULT_MAX_CONCURRENT_LOADS})",
    )
    parser.add_argument(
        "--adapter-load-deadline-s",
        type=float,
        default=DEFAULT_LOAD_DEADLINE_S,
        metavar="S",
        help=f"how long a request waits for its standby adapter's load before it is refused (default {DEFAULT_LOAD_DEADLINE_S:g})",
    )
    parser.add_argument(
        "--standby-memory-mib",
        type=int,
        default=0,
        metavar="MIB",
        help="keep standby adapters' verified snapshots in host memory too, up to this many MiB in all (the "
        "least recently standby-ed leave first); their first request loads from memory (default 0: off, disk only)",
    )
    parser.add_argument(
        "--standby-memory-dir",
        type=Path,
        default=DEFAULT_STANDBY_MEMORY_DIR,
        metavar="DIR",
        help="the memory-backed directory (tmpfs) of those copies, this agent's own; with --backend vllm the "
        f"servers read it at the same path (default {DEFAULT_STANDBY_MEMORY_DIR})",
    )
    parser.add_argument(
        "--exit-linger-s",
        type=float,
        default=DEFAULT_EXIT_LINGER_S,
        metavar="S",
        help=f"after a rank died, keep answering Describe this long before exiting (default {DEFAULT_EXIT_LINGER_S:g})",
    )


def add_storage_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Where s3:// and oci:// sources are read: the fleet owner's store and plain-HTTP registries
    (docs/sources-s3.md, docs/sources-oci.md); which buckets and repositories: --allow-source."""
    parser.add_argument(
        "--s3-endpoint",
        default="",
        metavar="URL",
        help="the S3-compatible store s3:// sources are read from (path-style), e.g. https://s3.us-east-1.amazonaws.com; "
        "none: s3:// sources refused. Credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) in "
        "the environment, unless a load brings its own",
    )
    parser.add_argument(
        "--s3-region",
        default=DEFAULT_S3_REGION,
        metavar="REGION",
        help=f"the region s3:// requests are signed for (default {DEFAULT_S3_REGION})",
    )
    parser.add_argument(
        "--s3-web-identity",
        action="store_true",
        help="without keys (a load's or AWS_ACCESS_KEY_ID's), sign s3:// requests with the pod's web identity: the token in "
        "AWS_WEB_IDENTITY_TOKEN_FILE exchanged for AWS_ROLE_ARN's temporary credentials at --s3-sts-endpoint (EKS IRSA)",
    )
    parser.add_argument(
        "--s3-sts-endpoint",
        default="",
        metavar="URL",
        help="the STS endpoint --s3-web-identity exchanges the token at (default https://sts.REGION.amazonaws.com, REGION the --s3-region)",
    )
    plain = "a registry (host[:port]) oci:// sources reach over plain HTTP instead of https (repeatable)"
    parser.add_argument("--oci-plain-http", action="append", default=[], metavar="REGISTRY", help=plain)
