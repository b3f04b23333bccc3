"""The node agent's domain errors.

Each class is one kind of refusal with a stable `reason` (the `reason` label of the failure
metric). The gRPC layer maps classes to status codes in one table (`server.STATUS_CODES`);
nothing below the servicer knows about gRPC. A backend's refusals become these in one place
(`backend_refusal`).
"""

from __future__ import annotations

from node_agent.backend import AdapterRefused, BackendError, Overloaded, RequestRefused, SnapshotChanged, Unsupported


class AgentError(Exception):
    """A call the agent refuses or cannot complete; the message is meant for the caller."""

    reason = "error"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class InvalidRequest(AgentError):
    """The request itself is malformed (bad name, empty batch, token outside the vocabulary)."""

    reason = "invalid_request"


class SourceRefused(AgentError):
    """The adapter source is not allowed or its content is not what was promised.

    Reasons: scheme, redirect, relative_path, traversal, outside_roots, symlink_escape,
    sha256_mismatch, too_large, no_cache_dir, bad_uri, http_error, credentials, file_host,
    not_a_directory, not_a_file, symlink_loop, unreadable; s3:// and oci:// sources add endpoint,
    no_s3_endpoint, digest_mismatch, bad_manifest, bad_layer, pickle, registry_auth, tag_moved,
    source_changed (a load's revision no longer what its source resolves to), web_identity (STS
    refused the pod's web identity).
    """

    reason = "source_refused"


class SourceNotFound(AgentError):
    """The source names a file or URL that does not exist."""

    reason = "source_not_found"


class SourceUnavailable(AgentError):
    """The source could not be fetched now (network error, server error); worth retrying."""

    reason = "download_failed"


class TooManyDownloads(AgentError):
    """As many downloads as the policy allows are running (`--max-concurrent-downloads`); retry later."""

    reason = "too_many_downloads"


class TooManyCalls(AgentError):
    """As many calls of one class (control, inference) run as the server's budget for it allows
    (`--max-control-calls`, `--max-inference-calls`) and its queue is full, or a queued call found
    no place within the queue's wait (reason `queue_timeout`); retry later."""

    reason = "too_many_calls"


class DeadlineExceeded(AgentError):
    """A queued call's deadline passed (or the call ended, reason `cancelled`) before it found a
    place in its budget: it never ran."""

    reason = "deadline_exceeded"


class ShuttingDown(AgentError):
    """The agent is stopping: it takes no new loads, unloads or inference (Describe still answers)."""

    reason = "shutting_down"


class AdapterNotFound(AgentError):
    """No routable adapter has this name (never loaded, failed to load, or being unloaded)."""

    reason = "not_found"


class AdapterConflict(AgentError):
    """The name is loaded with other content (or pinning) and `replace` was not set."""

    reason = "conflict"


class CapacityExceeded(AgentError):
    """A batch needs more device LoRA slots than the engine has."""

    reason = "capacity"


class RequestAborted(AgentError):
    """A running request lost its adapter (unloaded after the drain timeout)."""

    reason = "aborted"


class EngineUnavailable(AgentError):
    """The engine is not serving (a rank died or a call timed out); the agent will exit."""

    reason = "engine_unavailable"


class NotSupported(AgentError):
    """The agent's backend has no such capability (Forward or Generate on a backend without it)."""

    reason = "unsupported"


class LoadCancelled(AgentError):
    """The load's call ended (its client's deadline passed, or it cancelled) before the load
    reached the ranks: its download was stopped and nothing was loaded."""

    reason = "cancelled"


def backend_refusal(error: BackendError | AdapterRefused | RequestRefused, alive: bool) -> AgentError:
    """The domain error a backend's refusal becomes (`alive`: whether the backend still serves;
    a failure of one that does not is the agent's end)."""
    match error:
        case SnapshotChanged():  # the snapshot changed before the backend read it: fetch again
            return SourceUnavailable(str(error), "digest_mismatch")
        case AdapterRefused() | RequestRefused():
            return InvalidRequest(str(error))
        case Overloaded():
            return TooManyCalls(f"the engine's waiting queue is full: {error}", reason="queue_full")
        case Unsupported():
            return NotSupported(str(error))
        case _ if not alive:
            return EngineUnavailable(f"engine is not serving: {error}; the agent exits so its pod restarts")
        case _:
            return AgentError(f"engine error: {error}", "engine_error")
