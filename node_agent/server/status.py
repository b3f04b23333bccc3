"""Domain errors as gRPC statuses: the one table, and the abort that marks the agent's own refusals."""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from lorafleet_common.wire import REASON_METADATA_KEY
from node_agent.errors import (
    AdapterConflict,
    AdapterNotFound,
    AgentError,
    CapacityExceeded,
    DeadlineExceeded,
    EngineUnavailable,
    InvalidRequest,
    LoadCancelled,
    NotSupported,
    RequestAborted,
    ShuttingDown,
    SourceNotFound,
    SourceRefused,
    SourceUnavailable,
    TooManyCalls,
    TooManyDownloads,
)

log = logging.getLogger(__name__)

# The one place where domain errors become gRPC status codes (anything else: INTERNAL).
STATUS_CODES: dict[type[AgentError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SourceRefused: grpc.StatusCode.INVALID_ARGUMENT,
    SourceNotFound: grpc.StatusCode.NOT_FOUND,
    SourceUnavailable: grpc.StatusCode.UNAVAILABLE,
    TooManyDownloads: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooManyCalls: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    AdapterConflict: grpc.StatusCode.FAILED_PRECONDITION,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestAborted: grpc.StatusCode.ABORTED,
    EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
    NotSupported: grpc.StatusCode.UNIMPLEMENTED,
    LoadCancelled: grpc.StatusCode.CANCELLED,
}


def status_code(error: AgentError) -> grpc.StatusCode:
    """The status of a domain error: its class's in `STATUS_CODES`, INTERNAL for any other."""
    return STATUS_CODES.get(type(error), grpc.StatusCode.INTERNAL)


def abort(context: grpc.ServicerContext, error: Exception) -> NoReturn:
    """End the call with `error`'s status; an error that is no `AgentError` is a bug: INTERNAL, logged."""
    if isinstance(error, AgentError):
        # The reason marks the answer as the agent's own (the operator tells it from a crash).
        context.set_trailing_metadata(((REASON_METADATA_KEY, error.reason),))
        context.abort(status_code(error), str(error))
    log.exception("unexpected error in %s", type(error).__name__)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
    raise AssertionError("grpc's context.abort returned")  # it raises; this tells the type checker
