"""gRPC client for the node agents (``lorafleet.v1.NodeAgent``), as the operator uses it.

One channel per (endpoint, credentials), reused across reconciles; every call has its own
deadline and goes through two semaphores (per agent and in all), so a fan-out over many
adapters and agents stays bounded. Loads of remote (http(s)) sources, which can take as long
as a download, go through their own semaphore per (agent, namespace) instead: one tenant's
slow or black-holed downloads never hold the slots other adapters' calls need. Unloads wait
in a queue per agent (:class:`~lorafleet_operator.work_queue.WorkQueue`) drained by as many
workers as the agent has call slots, so thousands of deletions at once hold a future each
rather than a suspended call.
Loads of local sources that wait for one agent together go in one LoadAdapters call
(:meth:`AgentClients.load_many`; one LoadAdapter each to an agent older than that method).
gRPC failures become :class:`AgentError`, carrying the status code that :mod:`failures`
classifies.

The fleet's token goes to an endpoint only after it proved it is an agent holding it (or over a
verified TLS channel): :mod:`identity`, checked here before every token-bearing call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from lorafleet.v1 import agent_pb2, agent_pb2_grpc
from lorafleet_common.registry import RegistryEntry
from lorafleet_common.wire import REASON_METADATA_KEY
from lorafleet_operator import metrics
from lorafleet_operator.agent_values import (
    AdapterDemand,
    AgentBackend,
    AgentDemand,
    AgentError,
    AgentInfo,
    ControlReply,
    Credentials,
    LoadAnswer,
    LoadRequest,
    SourceCredential,
    SourceRevision,
    UnloadAnswer,
    resolve_message,
)
from lorafleet_operator.config import Settings
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.identity import (
    IDENTITY_UNCHECKED,
    NOT_AN_AGENT,
    UNDELIVERED,
    Identities,
    check_answer,
    new_nonce,
    refusal,
)
from lorafleet_operator.load_gate import LoadGate
from lorafleet_operator.sources import is_remote
from lorafleet_operator.work_queue import WorkQueue

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Reconnect quickly after an agent restart: gRPC's default back-off grows to two minutes,
#: during which calls to a healthy agent would fail fast with UNAVAILABLE.
CHANNEL_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


def _reason(err: grpc.aio.AioRpcError) -> str:
    for key, value in err.trailing_metadata() or ():
        if key == REASON_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


@contextlib.asynccontextmanager
async def _nothing() -> AsyncIterator[set[str]]:
    """The gate of a call that is not a load: no overlap to learn."""
    yield set()


#: gRPC status codes by their number (LoadAdapters answers each load's code as a number).
_CODES = {code.value[0]: code for code in grpc.StatusCode}


#: LoadAdapterResponse.residency: on standby or not (UNSPECIFIED, an older agent: not said).
_ON_STANDBY = {agent_pb2.ADAPTER_RESIDENCY_RESIDENT: False, agent_pb2.ADAPTER_RESIDENCY_STANDBY: True}


def control_reply(reply: Any, source_uri: str = "") -> ControlReply:
    """A load's or unload's reply; a load's (``source_uri``) with what its source resolved to."""
    ranks = list(reply.rank_results)
    revision = reply.source_revision if source_uri and reply.success else ""
    return ControlReply(
        success=bool(reply.success),
        error_message=reply.error_message,
        ranks_ok=sum(1 for r in ranks if r.success),
        ranks_reported=len(ranks),
        transient=not reply.success and bool(reply.transient),
        source=SourceRevision(source_uri, revision) if revision else None,
        on_standby=_ON_STANDBY.get(reply.residency) if source_uri else None,
    )


def _load_answer(outcome: Any, request: LoadRequest) -> LoadAnswer:
    """One load's outcome of a LoadAdapters reply, as its own LoadAdapter call would end."""
    if outcome.code == grpc.StatusCode.OK.value[0]:
        return control_reply(outcome.reply, request.source_uri)
    code = _CODES.get(outcome.code, grpc.StatusCode.UNKNOWN)
    return AgentError(code, outcome.error_message or code.name, reason=outcome.reason)


class AgentClients:
    """Channels and bounded, deadline-carrying calls to every agent the operator talks to."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._channels: dict[tuple[str, Credentials], grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, Credentials], agent_pb2_grpc.NodeAgentStub] = {}
        self._per_agent: dict[str, asyncio.Semaphore] = {}
        self._remote: dict[tuple[str, str], asyncio.Semaphore] = {}
        self._loads: dict[str, LoadGate] = {}
        self._unloads = WorkQueue(settings.per_agent_concurrency)
        #: (endpoint, name, credentials) -> the future of that unload while it waits its turn.
        self._waiting_unloads: dict[tuple[str, str, Credentials], asyncio.Future[UnloadAnswer]] = {}
        self._total = asyncio.Semaphore(settings.total_concurrency)
        #: Endpoints that answered LoadAdapters with UNIMPLEMENTED (agents older than it): their
        #: loads go one per LoadAdapter call, until the operator restarts.
        self._single_loads: set[str] = set()
        self.identities = Identities()
        self._proving: dict[str, asyncio.Lock] = {}

    def _stub(self, endpoint: str, creds: Credentials) -> agent_pb2_grpc.NodeAgentStub:
        """The stub over the channel to ``endpoint`` (one per channel: a stub builds a callable
        per method, too much to repeat for each of thousands of calls)."""
        key = (endpoint, creds)
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = agent_pb2_grpc.NodeAgentStub(self._channel(endpoint, creds))
        return stub

    def _channel(self, endpoint: str, creds: Credentials) -> grpc.aio.Channel:
        key = (endpoint, creds)
        channel = self._channels.get(key)
        if channel is None:
            options = list(CHANNEL_OPTIONS)
            if creds.tls:
                if creds.server_name:
                    options.append(("grpc.ssl_target_name_override", creds.server_name))
                tls = grpc.ssl_channel_credentials(creds.root_ca, creds.client_key, creds.client_cert)
                channel = grpc.aio.secure_channel(endpoint, tls, options=options)
            else:
                channel = grpc.aio.insecure_channel(endpoint, options=options)
            self._channels[key] = channel
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()

    @contextlib.asynccontextmanager
    async def _slots(self, endpoint: str, remote_of: str) -> AsyncIterator[None]:
        """The bounds a call runs under: a remote load of namespace ``remote_of`` only its own
        (agent, namespace) bound; every other call the agent's and the overall one."""
        if remote_of:
            remote = self._remote.setdefault((endpoint, remote_of), asyncio.Semaphore(self._settings.remote_loads_per_namespace))
            async with remote:
                yield
            return
        per_agent = self._per_agent.setdefault(endpoint, asyncio.Semaphore(self._settings.per_agent_concurrency))
        async with self._total, per_agent:
            yield

    def observe(self, pods: Sequence[AgentPod]) -> None:
        """The pods now behind their endpoints: a new one at an endpoint proves again."""
        self.identities.observe(pods)

    async def _ensure_agent(self, endpoint: str, creds: Credentials, stub: agent_pb2_grpc.NodeAgentStub) -> None:
        """Before the token goes to ``endpoint``: a verified TLS channel, or the identity proof
        (asked once per pod and token; concurrent first calls share one challenge)."""
        if not creds.token or creds.tls or self.identities.is_proven(endpoint, creds.token):
            return
        async with self._proving.setdefault(endpoint, asyncio.Lock()):
            if self.identities.is_proven(endpoint, creds.token):
                return
            nonce, pod = new_nonce(), self.identities.pod_at(endpoint)
            try:
                reply = await stub.ProveIdentity(
                    agent_pb2.ProveIdentityRequest(nonce=nonce, pod=pod), timeout=self._settings.call_deadline_s
                )
            except grpc.aio.AioRpcError as err:
                metrics.AGENT_CALLS.labels(method="ProveIdentity", code=err.code().name).inc()
                if err.code() in UNDELIVERED:
                    raise AgentError(
                        err.code(), f"identity check of {endpoint} failed: {err.details() or err.code().name}", reason=IDENTITY_UNCHECKED
                    ) from None
                why = f"ProveIdentity answered {err.code().name}"  # its details are not ours
            else:
                metrics.AGENT_CALLS.labels(method="ProveIdentity", code="OK").inc()
                why = check_answer(creds.token, pod, nonce, reply.proof)
            if why:
                message = refusal(endpoint, why)
                self.identities.refused(endpoint, creds.token, message)
                raise AgentError(grpc.StatusCode.PERMISSION_DENIED, message, reason=NOT_AN_AGENT)
            self.identities.prove(endpoint, creds.token)

    async def _call(
        self,
        endpoint: str,
        creds: Credentials,
        method: str,
        invoke: Callable[[agent_pb2_grpc.NodeAgentStub, Any, float], Awaitable[T]],
        deadline_s: float,
        *,
        remote_of: str = "",
        load: tuple[LoadGate, tuple[str, ...], bool] | None = None,
    ) -> T:
        """One call under its bounds (:meth:`_slots`). A ``load`` (the agent's gate, the
        adapters' names, exclusive or not) enters the gate once it holds its slot: the loads
        that overlap it are those sent to the agent meanwhile, never those still waiting for a
        slot; a failure says whether it was alone there (``AgentError.alone``: one load, and
        no other call's overlapping it)."""
        stub = self._stub(endpoint, creds)
        metadata = (("authorization", f"Bearer {creds.token}"),) if creds.token else None
        async with self._slots(endpoint, remote_of), load[0].enter(load[1], exclusive=load[2]) if load else _nothing() as overlap:
            await self._ensure_agent(endpoint, creds, stub)
            try:
                result = await invoke(stub, metadata, deadline_s)
            except grpc.aio.AioRpcError as err:
                metrics.AGENT_CALLS.labels(method=method, code=err.code().name).inc()
                raise AgentError(
                    err.code(),
                    err.details() or err.code().name,
                    reason=_reason(err),
                    alone=not overlap and load is not None and len(load[1]) == 1,
                ) from None
        metrics.AGENT_CALLS.labels(method=method, code="OK").inc()
        return result

    async def describe(self, endpoint: str, creds: Credentials) -> AgentInfo:
        reply = await self._call(
            endpoint,
            creds,
            "Describe",
            lambda s, md, t: s.Describe(agent_pb2.DescribeRequest(), metadata=md, timeout=t),
            self._settings.call_deadline_s,
        )
        topo, cap = reply.topology, reply.capacity
        return AgentInfo(
            base_model=reply.base_model.name,
            tp_size=topo.tp_size,
            dp_size=topo.dp_size,
            attn_tp_size=topo.attn_tp_size,
            ep_size=topo.ep_size or 1,
            moe_tp_size=topo.moe_tp_size,
            max_lora_rank=cap.max_lora_rank,
            max_loras_per_batch=cap.max_loras_per_batch,
            max_loaded_loras=cap.max_loaded_loras,
            backend=AgentBackend(reply.backend.kind, reply.backend.version, tuple(reply.backend.endpoints)),
        )

    async def load(
        self, endpoint: str, creds: Credentials, request: LoadRequest, *, exclusive: bool = False, namespace: str = ""
    ) -> ControlReply:
        """LoadAdapter; ``exclusive``: with no other load in flight on this agent. A failure
        says whether the load was alone there (``AgentError.alone``). A remote (http(s),
        hf://) source of ``namespace`` is bounded per (agent, namespace), apart from other
        calls."""
        remote_of = namespace if is_remote(request.source_uri) else ""
        message = request.message()
        reply = await self._call(
            endpoint,
            creds,
            "LoadAdapter",
            lambda s, md, t: s.LoadAdapter(message, metadata=md, timeout=t),
            self._settings.load_deadline_s,
            remote_of=remote_of,
            load=(self._loads.setdefault(endpoint, LoadGate()), (request.name,), exclusive),
        )
        return control_reply(reply, request.source_uri)

    async def resolve_source(self, endpoint: str, creds: Credentials, uri: str, credential: SourceCredential | None) -> str:
        """ResolveSource: the revision the agent finds the source at now (under a load's deadline)."""
        request, deadline = resolve_message(uri, credential), self._settings.load_deadline_s
        reply = await self._call(
            endpoint, creds, "ResolveSource", lambda s, md, t: s.ResolveSource(request, metadata=md, timeout=t), deadline
        )
        return str(reply.source_revision)

    async def load_many(self, endpoint: str, creds: Credentials, requests: Sequence[LoadRequest]) -> list[LoadAnswer]:
        """Loads of local sources on one agent in one LoadAdapters call (shared, under one call
        slot and one deadline): each load's outcome in their order, the call's own error as
        every load's. The loads overlap each other (none is ``alone``). An agent that does
        not know LoadAdapters (UNIMPLEMENTED: older than it) gets them one LoadAdapter call
        after the other, from then on."""
        if endpoint not in self._single_loads:
            messages = [r.message() for r in requests]
            try:
                reply = await self._call(
                    endpoint,
                    creds,
                    "LoadAdapters",
                    lambda s, md, t: s.LoadAdapters(agent_pb2.LoadAdaptersRequest(loads=messages), metadata=md, timeout=t),
                    self._settings.load_deadline_s,
                    load=(self._loads.setdefault(endpoint, LoadGate()), tuple(r.name for r in requests), False),
                )
            except AgentError as err:
                if err.code != grpc.StatusCode.UNIMPLEMENTED:
                    return [err] * len(requests)
                log.info("agent %s does not know LoadAdapters: one LoadAdapter call per load", endpoint)
                self._single_loads.add(endpoint)
            else:
                return [_load_answer(o, r) for o, r in zip(reply.outcomes, requests, strict=True)]
        answers: list[LoadAnswer] = []
        for request in requests:
            try:
                answers.append(await self.load(endpoint, creds, request))
            except AgentError as err:
                answers.append(err)
        return answers

    async def unload(self, endpoint: str, creds: Credentials, name: str) -> ControlReply:
        request = agent_pb2.UnloadAdapterRequest(name=name)
        reply = await self._call(
            endpoint,
            creds,
            "UnloadAdapter",
            lambda s, md, t: s.UnloadAdapter(request, metadata=md, timeout=t),
            self._settings.load_deadline_s,
        )
        return control_reply(reply)

    async def unload_each(self, calls: Sequence[tuple[str, Credentials, str]]) -> list[UnloadAnswer]:
        """UnloadAdapter of each (endpoint, credentials, name), queued on its agent
        (a :class:`~lorafleet_operator.work_queue.WorkQueue`); the outcomes in the same order. An unload of the same name
        still waiting on that agent (another deletion's, the drift check's) is shared, not
        sent twice. A caller that gives up (cancelled) leaves the queued unloads to run."""
        futures = [self._queue_unload(*call) for call in calls]
        if futures:
            await asyncio.wait(futures)  # unlike gather, cancelling the caller cancels none
        return [future.result() for future in futures]

    def _queue_unload(self, endpoint: str, creds: Credentials, name: str) -> asyncio.Future[UnloadAnswer]:
        key = (endpoint, name, creds)
        future = self._waiting_unloads.get(key)
        if future is None:

            def forget() -> None:
                self._waiting_unloads.pop(key, None)

            async def run() -> UnloadAnswer:
                forget()  # started: an unload of the name asked for from now on is sent again
                try:
                    return await self.unload(endpoint, creds, name)
                except AgentError as err:  # the agent's answer: its callers read it
                    return err

            future = self._waiting_unloads[key] = self._unloads.submit(endpoint, run, forget)
        return future

    async def downloads(self, endpoint: str, creds: Credentials) -> dict[str, tuple[int, int]]:
        """The loads whose source the agent is downloading now: name -> (bytes received, bytes
        the source declared so far); the agent answers without waiting on the loads."""
        reply = await self._call(
            endpoint,
            creds,
            "ListAdapters",
            lambda s, md, t: s.ListAdapters(agent_pb2.ListAdaptersRequest(), metadata=md, timeout=t),
            self._settings.call_deadline_s,
        )
        return {d.name: (d.bytes_done, d.bytes_total) for d in reply.downloading}

    async def list_adapters(self, endpoint: str, creds: Credentials) -> dict[str, RegistryEntry]:
        reply = await self._call(
            endpoint,
            creds,
            "ListAdapters",
            lambda s, md, t: s.ListAdapters(agent_pb2.ListAdaptersRequest(), metadata=md, timeout=t),
            self._settings.call_deadline_s,
        )
        standby = agent_pb2.ADAPTER_RESIDENCY_STANDBY
        return {
            a.name: RegistryEntry(a.name, a.source_uri, a.sha256, a.pinned, tuple(a.ranks), standby=a.residency == standby)
            for a in reply.adapters
        }

    async def adapter_stats(self, endpoint: str, creds: Credentials) -> AgentDemand:
        """Each adapter's demand on the agent (AdapterStats): the agent answers it without
        waiting behind loads or inference."""
        reply = await self._call(
            endpoint,
            creds,
            "AdapterStats",
            lambda s, md, t: s.AdapterStats(agent_pb2.AdapterStatsRequest(), metadata=md, timeout=t),
            self._settings.call_deadline_s,
        )
        demands = (
            AdapterDemand(a.adapter, a.running, a.waiting, a.generated_tokens, a.tokens_per_s, a.ttft_count, a.ttft_mean_s, a.ttft_p50_s)
            for a in reply.adapters
        )
        return AgentDemand(reply.taken_at_unix_s, reply.window_s, {demand.adapter: demand for demand in demands})
