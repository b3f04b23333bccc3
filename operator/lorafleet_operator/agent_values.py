"""What the operator and the node agents say to each other, as values: the calls' errors,
the credentials to reach an agent and a source, Describe, control replies and load requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from lorafleet.v1 import agent_pb2


class AgentError(Exception):
    """A failed call to an agent: its gRPC status code and the agent's message.

    ``reason`` is the agent's own mark (:data:`lorafleet_common.wire.REASON_METADATA_KEY`), "" when the call ended without
    one. ``alone`` (loads only): no other load was in flight on that agent during this one.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str = "", alone: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.alone = alone


@dataclass(frozen=True)
class Credentials:
    """How to reach a fleet's agents (from its Secret refs); the default is plaintext, no token."""

    token: str = ""
    root_ca: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    server_name: str = ""

    @property
    def tls(self) -> bool:
        return self.root_ca is not None


@dataclass(frozen=True)
class S3AccessKey:
    """An S3 access key the agent signs an s3:// source's requests with (SigV4); the session
    token is set for temporary credentials. Never in a repr."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str = field(default="", repr=False)


@dataclass(frozen=True)
class SourceCredential:
    """What an agent sends to a load's source (:mod:`credentials`): a bearer token, with a
    user name basic authentication, or an S3 access key. Never in a repr: no log line or
    traceback shows it."""

    token: str = field(default="", repr=False)
    username: str = field(default="", repr=False)
    password: str = field(default="", repr=False)
    s3: S3AccessKey | None = field(default=None, repr=False)


@dataclass(frozen=True)
class AgentBackend:
    """What serves an agent's adapters, as its Describe says: the kind ("lorafleet-engine",
    "vllm"), its version and where each rank is served (the servers' URLs; none for the builtin
    engine). Empty from an agent older than these fields."""

    kind: str = ""
    version: str = ""
    endpoints: tuple[str, ...] = ()


@dataclass(frozen=True)
class AgentInfo:
    """Describe, reduced to what the operator uses."""

    base_model: str
    tp_size: int
    dp_size: int
    attn_tp_size: int
    ep_size: int
    #: The TP width of each expert, as the agent built it (the operator derives no group).
    moe_tp_size: int
    max_lora_rank: int
    max_loras_per_batch: int
    max_loaded_loras: int
    backend: AgentBackend = AgentBackend()


@dataclass(frozen=True)
class AdapterDemand:
    """One adapter's demand on one agent, as its AdapterStats says ("" the base model):
    requests running and waiting now; tokens generated and times to first token over the
    agent's recent window."""

    adapter: str
    running: int
    waiting: int
    generated_tokens: int
    tokens_per_s: float
    ttft_count: int
    ttft_mean_s: float
    ttft_p50_s: float


@dataclass(frozen=True)
class AgentDemand:
    """An agent's AdapterStats: when it was taken (seconds since the epoch, the agent's clock),
    the window the rates cover, and each adapter's demand by name."""

    taken_at_unix_s: float
    window_s: float
    adapters: dict[str, AdapterDemand]


@dataclass(frozen=True)
class SourceRevision:
    """A source URI and the revision an agent's load of it resolved to (`source_revisions`)."""

    uri: str
    revision: str

    def to_status(self) -> dict[str, str]:
        """``status.source`` of a LoraAdapter."""
        return {"uri": self.uri, "revision": self.revision}


@dataclass(frozen=True)
class ControlReply:
    """LoadAdapter / UnloadAdapter reply: the agent's merge over its ranks, plus rank counts."""

    success: bool
    error_message: str
    ranks_ok: int
    ranks_reported: int
    # a failure that asking again soon may cure (the ranks that failed could not act now: a
    # stock server down or busy), retried on the transient back-off rather than a refusal's
    transient: bool = False
    # a load's: what its source resolved to (LoadAdapterResponse.source_revision), None if nothing
    source: SourceRevision | None = None
    # a load's: on standby after it (LoadAdapterResponse.residency; None where the agent does not
    # say). A standby load finds the adapter resident when a request loaded it, or still leases it.
    on_standby: bool | None = None


@dataclass(frozen=True)
class LoadRequest:
    """One load as the operator asks an agent for it (LoadAdapter, or one item of
    LoadAdapters). ``credential`` goes with it (the agent sends it to the source)."""

    name: str
    source_uri: str
    sha256: str
    pinned: bool
    replace: bool
    credential: SourceCredential | None = None
    revision: str = ""  # what the source must still resolve to (`source_revisions`)
    standby: bool = False  # held verified on disk, loaded to a slot by its first request

    def message(self) -> agent_pb2.LoadAdapterRequest:
        """The request on the wire."""
        request = agent_pb2.LoadAdapterRequest(
            name=self.name,
            source_uri=self.source_uri,
            sha256=self.sha256,
            pinned=self.pinned,
            replace=self.replace,
            source_revision=self.revision,
            standby=self.standby,
        )
        _carry_credential(request, self.credential)
        return request


def resolve_message(source_uri: str, credential: SourceCredential | None) -> agent_pb2.ResolveSourceRequest:
    """ResolveSource's request: the source and its credential, as a load of it carries them."""
    request = agent_pb2.ResolveSourceRequest(source_uri=source_uri)
    _carry_credential(request, credential)
    return request


def _carry_credential(request: agent_pb2.LoadAdapterRequest | agent_pb2.ResolveSourceRequest, credential: SourceCredential | None) -> None:
    """The credential into the request's fields: an S3 key, a user and password, or a token."""
    if credential is not None and credential.s3 is not None:
        key = credential.s3
        request.source_s3.access_key_id = key.access_key_id
        request.source_s3.secret_access_key = key.secret_access_key
        request.source_s3.session_token = key.session_token
    elif credential is not None and credential.username:
        request.source_basic.username = credential.username
        request.source_basic.password = credential.password
    elif credential is not None:
        request.source_token = credential.token


#: An unload's outcome as its callers get it: the agent's reply, or the call's error.
UnloadAnswer = ControlReply | AgentError
#: One load's outcome of a call of several: the agent's reply, or its error.
LoadAnswer = ControlReply | AgentError
