"""`helm test`: every agent behind the agent Service answers, as the operator would reach it.

Runs in the agent image (grpcio, grpc health, the lorafleet.v1 stubs). Environment:
AGENT_SERVICE (the headless Service's DNS name), GRPC_PORT, REPLICAS (how many agents must
answer), BASE_MODEL, TP_SIZE, TOKEN_FILE (bearer token; empty: none), TLS_DIR (ca.crt, tls.crt,
tls.key; empty: plaintext), TLS_SERVER_NAME, TIMEOUT_S.

For each address of the Service: grpc.health.v1 Check is SERVING, and Describe, sent with the
token, reports the configured base model and tp size (so the token works and an agent without
it would be refused). Prints one line per agent; exit status 1 if any agent does not pass
before the deadline.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import agent_pb2, agent_pb2_grpc


def channel(address: str, tls_dir: str, server_name: str) -> grpc.Channel:
    if not tls_dir:
        return grpc.insecure_channel(address)
    d = Path(tls_dir)
    creds = grpc.ssl_channel_credentials(
        root_certificates=(d / "ca.crt").read_bytes(),
        private_key=(d / "tls.key").read_bytes(),
        certificate_chain=(d / "tls.crt").read_bytes(),
    )
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=options)


def check(ip: str, env: dict[str, str], token: str) -> str:
    """'' when the agent at ``ip`` passes, else what is wrong."""
    host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod address
    with channel(f"{host}:{env['GRPC_PORT']}", env.get("TLS_DIR", ""), env.get("TLS_SERVER_NAME", "")) as ch:
        try:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                return f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}"
            metadata = [("authorization", f"Bearer {token}")] if token else []
            desc = agent_pb2_grpc.NodeAgentStub(ch).Describe(agent_pb2.DescribeRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if desc.base_model.name != env["BASE_MODEL"] or desc.topology.tp_size != int(env["TP_SIZE"]):
        return f"serves {desc.base_model.name!r} on tp={desc.topology.tp_size}, the chart says {env['BASE_MODEL']!r} on tp={env['TP_SIZE']}"
    return ""


def main() -> int:
    env = dict(os.environ)
    token_file = env.get("TOKEN_FILE", "")
    token = Path(token_file).read_text().strip() if token_file else ""
    deadline = time.monotonic() + float(env.get("TIMEOUT_S", "120"))
    want = int(env["REPLICAS"])
    problems: dict[str, str] = {}
    while True:
        try:
            ips = sorted({info[4][0] for info in socket.getaddrinfo(env["AGENT_SERVICE"], None, proto=socket.IPPROTO_TCP)})
        except OSError as exc:
            ips, problems = [], {env["AGENT_SERVICE"]: f"does not resolve: {exc}"}
        if ips:
            problems = {ip: why for ip in ips if (why := check(ip, env, token))}
            if len(ips) < want:
                problems["agents"] = f"{len(ips)} of {want} behind the Service"
        if not problems:
            for ip in ips:
                print(f"agent {ip}: SERVING, Describe answered ({env['BASE_MODEL']}, tp={env['TP_SIZE']})")
            return 0
        if time.monotonic() > deadline:
            for what, why in sorted(problems.items()):
                print(f"agent {what}: {why}", file=sys.stderr)
            return 1
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
