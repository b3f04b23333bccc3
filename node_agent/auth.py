"""Who may call the agent: a bearer token (interceptor) and TLS / mutual TLS credentials; and
how the agent proves to a client that it holds the token before the client sends it.

The health service stays open without a token so that kubelet's gRPC probes, which cannot
send metadata, keep working; so does ``ProveIdentity``, which a client calls before it sends the
token (its answer is a MAC of the client's nonce, `lorafleet_common.identity`). Every other
method (reflection included) needs the token.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from lorafleet_common.identity import NONCE_BYTES, identity_proof
from node_agent.errors import InvalidRequest

log = logging.getLogger(__name__)

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/lorafleet.v1.NodeAgent/ProveIdentity")

_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class BearerTokenInterceptor:
    """Refuses calls without `authorization: Bearer <token>` with UNAUTHENTICATED.

    A `grpc.ServerInterceptor` by shape: gRPC calls `intercept_service` and checks no base class.
    It does not subclass `grpc.ServerInterceptor` because grpcio ships no type information, and a
    class derived from an untyped base is itself untyped to mypy.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token is empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        presented = next((value for key, value in handler_call_details.invocation_metadata if key == "authorization"), None)
        if presented is None:
            return _refusing(continuation(handler_call_details), "missing credentials: send metadata 'authorization: Bearer <token>'")
        # Constant-time comparison: response timing must not reveal how much of a guess matched.
        if not hmac.compare_digest(str(presented).encode(), self._expected):
            return _refusing(continuation(handler_call_details), "invalid bearer token")
        return continuation(handler_call_details)


def _refusing(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler | None:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""
    if handler is None:
        return None  # unknown method: UNIMPLEMENTED, as without auth

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def prove_identity(token: str | None, own_pod: str | None, pod: str, nonce: bytes) -> bytes:
    """This agent's answer to a client's challenge for `pod`: HMAC-SHA256(token, CONTEXT || pod ||
    0x00 || nonce). Nothing when the agent has no token (it cannot prove holding one), or when it
    knows its own pod (`own_pod`, --pod-name) and the challenge is for another: a relay."""
    if len(nonce) != NONCE_BYTES:
        raise InvalidRequest(f"an identity challenge is a {NONCE_BYTES}-byte nonce, got {len(nonce)} byte(s)")
    if own_pod and pod != own_pod:
        log.warning("identity challenge for pod %r not answered: this agent is %r (--pod-name)", pod, own_pod)
        return b""
    return identity_proof(token, pod, nonce) if token else b""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the server's certificate chain and key, and optionally the CA that client
    certificates must chain to (mutual TLS: clients without such a certificate are refused)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        client_ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


def read_token(path: Path) -> str:
    """The token in `path` (surrounding whitespace, e.g. a trailing newline, ignored)."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    if any(c.isspace() for c in token):
        raise ValueError(f"auth token in {path} contains whitespace")
    return token
