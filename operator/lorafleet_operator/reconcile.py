"""The core of reconciliation, shared by the kopf handlers and the drift check.

A :class:`FleetView` is one look at a fleet: its agent pods, what each agent says it is
(Describe), and the credentials to reach them. Loads and unloads fan out over the target agents
concurrently (bounded in :mod:`agent_client`), and every agent's outcome becomes an
:class:`~lorafleet_operator.status.AgentResult`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
from kubernetes.client.exceptions import ApiException

from lorafleet_common.merge import merge_failure_first
from lorafleet_common.registry import RegistryEntry
from lorafleet_operator import names, progress, sources
from lorafleet_operator.agent_client import (
    AgentError,
    AgentInfo,
    ControlReply,
    Credentials,
    LoadAnswer,
    LoadRequest,
    SourceCredential,
)
from lorafleet_operator.credentials import source_credential
from lorafleet_operator.failures import (
    AdapterGeneration,
    AgentFailure,
    FailureKey,
    FleetProblem,
    agent_state,
    answered,
    bearer_token,
    crash_verdict,
    died_under,
    failure_message,
    incarnation,
)
from lorafleet_operator.fleet import AgentPod, agents_of
from lorafleet_operator.identity import report_impostors
from lorafleet_operator.kube import SecretData
from lorafleet_operator.placement import Candidate, Demand, Placement, place
from lorafleet_operator.runtime import FleetAgents, Listing, Runtime
from lorafleet_operator.status import AgentResult, AgentState, ServedVersion

log = logging.getLogger(__name__)
T = TypeVar("T")
#: One agent's registry (ListAdapters by name), or the error that stands for it.
Registry = Mapping[str, RegistryEntry] | AgentError

#: A Secret's owner opens it to every LoraFleet of its namespace with this label ("true"),
#: or to one of them (the label's value is the fleet's name) ...
ALLOW_LABEL = "lorafleet.dev/allow-fleet"
#: ... or to some of them with this annotation: their names, comma-separated (fleet names may
#: be longer than a label value's 63 characters).
ALLOW_ANNOTATION = "lorafleet.dev/allowed-fleets"
#: The Ready condition's reason when a fleet names a Secret it may not use (whatever the cause).
SECRET_NOT_OPENED = "SecretNotOpened"
#: The Ready condition's reason while the fleet is being deleted, and after (docs/operator.md).
FLEET_DELETED = "FleetDeleted"
#: The Ready condition's reasons for an adapter its fleet does not admit (fleet owner's policy).
PINNING_NOT_ALLOWED = "PinningNotAllowed"
SOURCE_NOT_ALLOWED = "SourceNotAllowed"


def admission(fleet_name: str, fleet_spec: Mapping[str, Any], adapter_spec: Mapping[str, Any]) -> FleetProblem | None:
    """Whether the fleet's owner lets this adapter onto the fleet's agents (None: yes), checked
    before any load: a pinned adapter only where ``spec.pinning.allowed`` is true (pinning is
    a privilege the fleet grants, not every adapter creator's right), an http(s) or hf://
    source only under one of ``spec.sources.allow`` (:mod:`~lorafleet_operator.sources`; none
    by default: remote sources are off until the owner names prefixes; the agents'
    --allow-source stays the second line)."""
    if adapter_spec.get("pinned") and not (fleet_spec.get("pinning") or {}).get("allowed"):
        return FleetProblem(
            PINNING_NOT_ALLOWED,
            f"LoraFleet {fleet_name!r} does not allow pinned adapters (its owner sets spec.pinning.allowed: true); not loaded",
        )
    uri = str(adapter_spec["source"]["uri"])
    allowed = [str(p) for p in (fleet_spec.get("sources") or {}).get("allow") or []]
    if not sources.admitted(uri, allowed):
        return FleetProblem(
            SOURCE_NOT_ALLOWED,
            f"LoraFleet {fleet_name!r} does not allow "
            f"this http(s) or hf:// source: it is under none of "
            f"the fleet's spec.sources.allow prefixes "
            f"({len(allowed)} set by its owner); not "
            f"loaded",
        )
    return None


@dataclass(frozen=True)
class Target:
    """An agent an adapter should be on; ``info`` is None when Describe did not answer."""

    agent: AgentPod
    info: AgentInfo | None
    error: AgentError | None = None

    @property
    def ranks_total(self) -> int:
        return self.info.tp_size if self.info else 0


@dataclass(frozen=True)
class FleetView:
    """One look at a fleet: its agent pods, their Describe (or its error), the credentials."""

    namespace: str
    agents: tuple[AgentPod, ...]
    infos: Mapping[str, AgentInfo | AgentError]
    creds: Credentials
    #: The LoraFleet's name and spec, as looked at (its owner's policy: :func:`admission`).
    name: str = ""
    spec: Mapping[str, Any] = field(default_factory=dict)

    def admit(self, adapter_spec: Mapping[str, Any]) -> None:
        """Raise the fleet's refusal of this adapter (:func:`admission`), if any."""
        problem = admission(self.name, self.spec, adapter_spec)
        if problem is not None:
            raise problem

    @property
    def dialable(self) -> list[AgentPod]:
        return [a for a in self.agents if a.dialable]


def opened_to(secret: SecretData, fleet: str) -> bool:
    """Whether the Secret's owner opened it to this fleet (:data:`ALLOW_LABEL` "true" or the
    fleet's name, or :data:`ALLOW_ANNOTATION` naming the fleet)."""
    if secret.labels.get(ALLOW_LABEL) in ("true", fleet):
        return True
    allowed = secret.annotations.get(ALLOW_ANNOTATION, "")
    return fleet in {n.strip() for n in allowed.split(",") if n.strip()}


async def opened_secret(rt: Runtime, namespace: str, fleet: str, name: str, keys: Sequence[str]) -> Mapping[str, bytes]:
    """The data of a Secret the fleet may use: opened to it by its owner and holding ``keys``.

    Anything else — missing, not readable by the operator, not opened, a key missing — is
    refused with one and the same message, which says nothing about the Secret: a fleet's
    author learns no more than they wrote (the confused-deputy rule, docs/operator.md
    "Security"). Other API errors (the server down or busy) are transient and escape."""
    refused = FleetProblem(
        SECRET_NOT_OPENED,
        f"LoraFleet {fleet!r} may not use Secret {name!r} with key(s) "
        f"{', '.join(repr(k) for k in keys)}: the operator uses only Secrets of this namespace "
        f'that their owner opened to lorafleet (label {ALLOW_LABEL}="true" or the fleet\'s '
        f"name, or annotation {ALLOW_ANNOTATION} naming the fleet) and that hold the named key(s)",
    )
    try:
        secret = await rt.kube.get_secret(namespace, name)
    except ApiException as err:
        if err.status in (403, 404):
            raise refused from None
        raise
    if not opened_to(secret, fleet) or any(k not in secret.data for k in keys):
        raise refused
    return secret.data


async def credentials(rt: Runtime, namespace: str, fleet: str, spec: Mapping[str, Any]) -> Credentials:
    """The fleet's token and TLS material, read from Secrets opened to it (by name: no list
    rights). The token is trimmed and checked (:func:`~lorafleet_operator.failures.bearer_token`)."""
    token = ""
    auth = spec.get("auth")
    if auth:
        ref = auth["tokenSecretRef"]
        key = ref.get("key") or "token"
        token = bearer_token((await opened_secret(rt, namespace, fleet, ref["name"], (key,)))[key])
    tls = spec.get("tls")
    if not tls:
        return Credentials(token=token)
    data = await opened_secret(rt, namespace, fleet, tls["secretRef"]["name"], ("ca.crt",))
    return Credentials(
        token=token,
        root_ca=data["ca.crt"],
        client_cert=data.get("tls.crt"),
        client_key=data.get("tls.key"),
        server_name=tls.get("serverName", ""),
    )


async def ask_each(agents: Sequence[AgentPod], call: Callable[[AgentPod], Awaitable[T]]) -> dict[str, T | AgentError]:
    """``call`` on every agent at once; by pod name, its answer or the AgentError it raised."""

    async def one(agent: AgentPod) -> T | AgentError:
        try:
            return await call(agent)
        except AgentError as err:
            return err

    answers = await asyncio.gather(*(one(a) for a in agents))
    return {a.name: answer for a, answer in zip(agents, answers, strict=True)}


async def describe_all(rt: Runtime, agents: Sequence[AgentPod], creds: Credentials, *, fresh: bool) -> dict[str, AgentInfo | AgentError]:
    """Describe every dialable agent (cached per pod incarnation unless ``fresh``; reconciles
    that find no answer cached share the call in flight)."""

    async def ask(agent: AgentPod, key: tuple[str, int, str]) -> AgentInfo:
        info = rt.describe_cache[key] = await rt.agents.describe(agent.endpoint, creds)
        return info

    async def describe(agent: AgentPod) -> AgentInfo:
        key = (agent.uid, agent.restarts, agent.endpoint)
        if fresh:
            return await ask(agent, key)
        cached = rt.describe_cache.get(key)
        if cached is not None:
            return cached
        return await rt.describes.get(key, lambda: ask(agent, key))

    dialable = [a for a in agents if a.dialable]
    rt.agents.observe(dialable)  # a new pod at an endpoint proves again
    if not fresh:
        cached = _all_cached(dialable, lambda a: rt.describe_cache.get((a.uid, a.restarts, a.endpoint)))
        if cached is not None:
            return dict(cached)
    return await ask_each(dialable, describe)


def _all_cached(agents: Sequence[AgentPod], cached: Callable[[AgentPod], T | None]) -> dict[str, T] | None:
    """Every agent's cached answer by pod name, or None when one has none: the reconciles
    of a thousand adapters then take the answers without a task per agent each (64 tasks
    per look, twice per reconcile, were about 4% of the operator's CPU at 300 adapters x 64
    agents, py-spy, 2026-12-02)."""
    answers: dict[str, T] = {}
    for agent in agents:
        answer = cached(agent)
        if answer is None:
            return None
        answers[agent.name] = answer
    return answers


async def look_up_fleet(rt: Runtime, namespace: str, name: str) -> Mapping[str, Any] | None:
    """The LoraFleet as kopf's fleet index has it (``handlers.lora_fleets``: current with the
    watch, no request); None when the API server does not have it either. A fleet the index
    lacks is asked for: one created a moment ago whose watch event has not arrived yet is
    found, and a missing one is confirmed missing (as when every reconcile read it)."""
    indexed = next(iter(rt.fleets.get((namespace, name), ())), None)
    if indexed is not None:
        return indexed
    return await rt.kube.get_fleet(namespace, name)


async def fleet_view(rt: Runtime, namespace: str, fleet_name: str, *, fresh: bool = False, terminating_ok: bool = False) -> FleetView:
    """Look at a fleet now. Raises FleetProblem when it is missing or unusable, or being deleted
    (unless ``terminating_ok``: unloads still reach the agents of a fleet being deleted)."""
    fleet = await look_up_fleet(rt, namespace, fleet_name)
    if fleet is None:
        raise FleetProblem("FleetNotFound", f"LoraFleet {fleet_name!r} not found in {namespace}")
    if fleet["metadata"].get("deletionTimestamp") and not terminating_ok:
        raise FleetProblem(FLEET_DELETED, f"LoraFleet {fleet_name!r} is being deleted: its adapters are unloaded from its agents")
    spec = fleet.get("spec") or {}
    agents = fleet_agents(rt, namespace, fleet_name, spec)
    rt.crashes.observe(agents)  # a restart since a load that ended unanswered is a crash
    creds = await credentials(rt, namespace, fleet_name, spec)
    infos = await describe_all(rt, agents, creds, fresh=fresh)
    await report_impostors(rt.kube, rt.agents.identities, agents, infos)
    view = FleetView(namespace, agents, infos, creds, fleet_name, spec)
    if view.dialable:
        rt.last_views[(namespace, fleet_name)] = view
    return view


def fleet_agents(rt: Runtime, namespace: str, fleet_name: str, spec: Mapping[str, Any]) -> tuple[AgentPod, ...]:
    """The fleet's agents (:func:`~lorafleet_operator.fleet.agents_of`) among kopf's pod
    index, made again only when the fleet's spec or a pod of the namespace changed (kopf
    replaces the objects of what changed: compared by identity). Made at every reconcile,
    they were about 3% of the operator's CPU at 300 adapters x 64 agents (py-spy,
    2026-12-04)."""
    pods = tuple(rt.pods.get(namespace, ()))
    known = rt.fleet_agents.get((namespace, fleet_name))
    if (
        known is not None
        and known.spec is spec
        and len(known.pods) == len(pods)
        and all(a is b for a, b in zip(known.pods, pods, strict=True))
    ):
        return known.agents
    agents = tuple(agents_of(spec, list(pods)))
    rt.fleet_agents[(namespace, fleet_name)] = FleetAgents(spec, pods, agents)
    return agents


async def unload_view(rt: Runtime, namespace: str, fleet_name: str) -> tuple[FleetView | None, str]:
    """Where a deletion unloads: the fleet as it is now, or — when that says nothing (the
    fleet unusable or gone, its pods gone, or the operator's namespaced rights gone while the
    namespace terminates: 403) — the last view of it that had agents (their endpoints and the
    credentials then). Namespace deletion removes pods, Secrets and RoleBindings before the
    operator's finalizers run; the agent processes behind those pods may serve other
    namespaces and still hold the adapters. Returns the view (None: nowhere known) and why
    the current look failed ("" when it did not)."""
    try:
        view: FleetView | None = await fleet_view(rt, namespace, fleet_name, terminating_ok=True)
        problem = ""
    except FleetProblem as err:
        view, problem = None, err.message
    except ApiException as err:
        if err.status not in (403, 404):
            raise
        view, problem = None, f"Kubernetes API: {err.status} {err.reason}"
    if view is not None and view.agents:
        return view, problem
    return rt.last_views.get((namespace, fleet_name), view), problem


def loaded_result(target: Target, reply: ControlReply) -> AgentResult:
    """A target that holds the adapter after a successful load reply."""
    total = target.ranks_total or reply.ranks_reported
    ranks = reply.ranks_ok if reply.ranks_reported else total
    return AgentResult(target.agent.name, AgentState.LOADED, ranks, total)


def error_result(target: Target, failure: AgentFailure) -> AgentResult:
    """A target whose call failed: Unreachable or Failed as the policy classifies it."""
    return AgentResult(
        target.agent.name, agent_state(failure), 0, target.ranks_total, failure_message(failure, "the agent refused the adapter")
    )


def generation_key(body: Mapping[str, Any]) -> AdapterGeneration:
    """What a crash during a load counts against: this adapter generation."""
    meta = body["metadata"]
    return (meta.get("uid", ""), int(meta.get("generation", 0)))


def condemned(rt: Runtime, body: Mapping[str, Any]) -> str:
    """Why this adapter generation is sent to no agent ("" while it may be loaded)."""
    return crash_verdict(rt.crashes, generation_key(body), body.get("status"))


def backing_off(rt: Runtime, body: Mapping[str, Any], target: Target) -> AgentResult | None:
    """The last failed load's result on this target while its back-off has not passed (the
    one rule for handlers and the drift check alike); None when a load is due."""
    entry = rt.failures.waiting(failure_key(body, target.agent.name), incarnation(target.agent))
    return entry.result if entry is not None else None


async def served_version(rt: Runtime, view: FleetView, target: Target, body: Mapping[str, Any]) -> ServedVersion | None:
    """The version of the adapter the agent still holds after a failed load (its registry
    entry, when it differs from the spec: a failed replace keeps the old weights routed);
    None when it holds none or its registry cannot be listed now."""
    meta = body["metadata"]
    try:
        registry = await rt.agents.list_adapters(target.agent.endpoint, view.creds)
    except AgentError:
        return None
    entry = registry.get(names.agent_name(meta["namespace"], meta["name"]))
    return ServedVersion(entry.source_uri, entry.sha256) if entry is not None else None


#: An adapter's source credential as read for its loads: the value, none named, or why the
#: operator will not send it (:func:`adapter_credential`).
CredentialOutcome = SourceCredential | FleetProblem | None


async def adapter_credential(rt: Runtime, view: FleetView, body: Mapping[str, Any]) -> CredentialOutcome:
    """The adapter's source credential (:mod:`~lorafleet_operator.credentials`), read once
    for all of its loads of this look; the refusal when the operator will not send it (a
    Secret not opened to the fleet, its own agent Secret, ...): nothing is sent then, and
    nothing booked, so the next look reads the Secret again."""
    try:
        return await source_credential(
            body["spec"], view.name, view.spec, lambda name, keys: opened_secret(rt, view.namespace, view.name, name, keys)
        )
    except FleetProblem as problem:
        return problem


def credential_refusal(credential: CredentialOutcome, results: Sequence[AgentResult]) -> FleetProblem | None:
    """The credential refusal that is the adapter's status: refused while no agent serves
    it. The adapter is then Pending with the refusal's reason (``SecretNotOpened``: its
    message says what the Secret's owner does), not Failed: no agent refused anything."""
    if isinstance(credential, FleetProblem) and not any(r.serving for r in results):
        return credential
    return None


def unsent(rt: Runtime, target: Target, body: Mapping[str, Any], credential: CredentialOutcome) -> AgentResult | None:
    """The result of a load that is not sent, None when it is to be sent: the generation is
    condemned, the agent's Describe failed, its last failure there is backing off, or the
    ``credential`` is refused (nothing sent: not booked)."""
    verdict = condemned(rt, body)
    if verdict:
        return AgentResult(target.agent.name, AgentState.FAILED, 0, target.ranks_total, verdict)
    if target.error is not None:
        return error_result(target, target.error)
    waiting = backing_off(rt, body, target)
    if waiting is not None:
        return waiting
    if isinstance(credential, FleetProblem):
        return AgentResult(target.agent.name, AgentState.FAILED, 0, target.ranks_total, credential.message)
    return None


async def load_pinned(
    rt: Runtime, view: FleetView, target: Target, body: Mapping[str, Any], credential: SourceCredential | None
) -> AgentResult:
    """A pinned load: one at a time per agent, under the lock the count of pins is taken
    under (:func:`pin_refusal`)."""
    async with rt.pin_lock(target.agent.endpoint):
        refusal = await pin_refusal(rt, view, target, body)
        if refusal:
            return AgentResult(
                target.agent.name, AgentState.FAILED, 0, target.ranks_total, refusal, served=await served_version(rt, view, target, body)
            )
        _sending(rt, target, body)
        return await _load(rt, view, target, body, credential)


def pin_cap(info: AgentInfo) -> int:
    """How many adapters may be pinned on one agent: ``max_loras_per_batch − 1`` (SGLang's
    rule), so one device slot per rank always stays for unpinned traffic."""
    return max(info.max_loras_per_batch - 1, 0)


async def pin_refusal(rt: Runtime, view: FleetView, target: Target, body: Mapping[str, Any]) -> str:
    """Why the agent cannot take this adapter pinned ("" when it can): it already holds
    :func:`pin_cap` pinned adapters (of any namespace) besides this one. Not booked as a
    failed load: nothing was sent, and the next look counts again (a pin may be released)."""
    if target.info is None:
        return ""
    meta = body["metadata"]
    own = names.agent_name(meta["namespace"], meta["name"])
    try:
        registry = await rt.agents.list_adapters(target.agent.endpoint, view.creds)
    except AgentError as err:
        return f"could not count the agent's pinned adapters: {err.message}"
    pinned = sum(1 for name, entry in registry.items() if entry.pinned and name != own)
    cap = pin_cap(target.info)
    if pinned < cap:
        return ""
    return (
        f"cannot pin on {target.agent.name}: it holds {pinned} pinned adapter(s) and at most "
        f"{cap} may be pinned (max_loras_per_batch {target.info.max_loras_per_batch} − 1: "
        f"one device slot stays for unpinned traffic); not loaded"
    )


def _sending(rt: Runtime, target: Target, body: Mapping[str, Any]) -> None:
    """Book a load as sent from now: counted as held while in flight (placement: a reconcile
    placing meanwhile sees it, even while it waits in the agent's queue), and unsettled until
    it ends answered (a load cut off may still complete there)."""
    meta = body["metadata"]
    name = names.agent_name(meta["namespace"], meta["name"])
    rt.reservations.reserve(target.agent.endpoint, name)
    rt.sent.sending(target.agent.endpoint, name)


def _never_sent(rt: Runtime, target: Target, body: Mapping[str, Any]) -> None:
    """Undo :func:`_sending` for a queued load its caller gave up before it was sent."""
    meta = body["metadata"]
    name, now = names.agent_name(meta["namespace"], meta["name"]), time.monotonic()
    rt.sent.ended(target.agent.endpoint, name, now, answered=True)
    rt.reservations.finished(target.agent.endpoint, name, now, loaded=False)


def _request(body: Mapping[str, Any], credential: SourceCredential | None) -> LoadRequest:
    """The load the adapter's spec asks of an agent (replace: the spec is the truth for
    managed names), with its source's credential."""
    spec, meta = body["spec"], body["metadata"]
    return LoadRequest(
        names.agent_name(meta["namespace"], meta["name"]),
        spec["source"]["uri"],
        spec["source"].get("sha256", ""),
        bool(spec.get("pinned", False)),
        replace=True,
        credential=credential,
    )


async def _load(rt: Runtime, view: FleetView, target: Target, body: Mapping[str, Any], credential: SourceCredential | None) -> AgentResult:
    """The LoadAdapter call itself (with the source's credential; booked as sent before:
    :func:`_sending`) and the books (:func:`_book`)."""
    answer: LoadAnswer
    try:
        answer = await rt.agents.load(
            target.agent.endpoint,
            view.creds,
            _request(body, credential),
            exclusive=rt.crashes.isolate(generation_key(body)),
            namespace=body["metadata"]["namespace"],
        )
    except AgentError as err:
        answer = err
    return await _result(rt, view, target, body, _book(rt, target, body, answer))


@dataclass(frozen=True)
class QueuedLoad:
    """A load of a local source waiting in its agent's queue (``Runtime.loads``), booked as
    sent (:func:`_sending`)."""

    view: FleetView
    target: Target
    body: Mapping[str, Any]
    credential: SourceCredential | None


def loads_join(rt: Runtime, first: QueuedLoad, other: QueuedLoad) -> bool:
    """Whether ``other`` may go in the same LoadAdapters call as ``first`` (the queue asks
    when it sends): the same credentials, and neither generation is to load alone
    (:meth:`~lorafleet_operator.failures.CrashBook.isolate`)."""
    return (
        first.view.creds == other.view.creds
        and not rt.crashes.isolate(generation_key(first.body))
        and not rt.crashes.isolate(generation_key(other.body))
    )


async def send_loads(rt: Runtime, loads: Sequence[QueuedLoad]) -> list[AgentResult]:
    """Send the queued loads of one agent (``Runtime.loads``): one alone as LoadAdapter (it
    may be exclusive), several in one LoadAdapters call
    (:meth:`~lorafleet_operator.agent_client.AgentClients.load_many`); each load's books as
    after its own call (:func:`_book`, every one before any failure's registry read). Their
    results in their order."""
    if len(loads) == 1:
        one = loads[0]
        return [await _load(rt, one.view, one.target, one.body, one.credential)]
    first = loads[0]
    answers = await rt.agents.load_many(first.target.agent.endpoint, first.view.creds, [_request(q.body, q.credential) for q in loads])
    booked = [_book(rt, q.target, q.body, answer) for q, answer in zip(loads, answers, strict=True)]
    return [await _result(rt, q.view, q.target, q.body, b) for q, b in zip(loads, booked, strict=True)]


def _book(rt: Runtime, target: Target, body: Mapping[str, Any], answer: LoadAnswer) -> AgentResult | AgentFailure:
    """The books after one load's answer (the loads sent, the reservations, the crash book):
    the loaded result (its back-off cleared), or how it failed."""
    key, pod = generation_key(body), target.agent.name
    meta = body["metadata"]
    name, endpoint = names.agent_name(meta["namespace"], meta["name"]), target.agent.endpoint
    now = time.monotonic()
    if isinstance(answer, AgentError):
        rt.sent.ended(endpoint, name, now, answered=answered(answer))
        rt.reservations.finished(endpoint, name, now, loaded=False)
        if died_under(answer):
            rt.crashes.suspect(key, pod, incarnation(target.agent), alone=answer.alone, message=answer.message)
        else:
            rt.crashes.answered(key, pod, loaded=False)
        return answer
    rt.sent.ended(endpoint, name, now, answered=True)
    rt.reservations.finished(endpoint, name, now, loaded=answer.success)
    rt.crashes.answered(key, pod, loaded=answer.success)
    if answer.success:
        return rt.failures.remember(failure_key(body, pod), incarnation(target.agent), loaded_result(target, answer))
    return answer


async def _result(rt: Runtime, view: FleetView, target: Target, body: Mapping[str, Any], booked: AgentResult | AgentFailure) -> AgentResult:
    """A load's result from its books (:func:`_book`): a failure the agent answered also
    says which version it still serves; booked in the back-off book."""
    if isinstance(booked, AgentResult):
        return booked
    result = error_result(target, booked)
    if answered(booked):
        result = replace(result, served=await served_version(rt, view, target, body))
    return rt.failures.remember(failure_key(body, target.agent.name), incarnation(target.agent), result)


def failure_key(body: Mapping[str, Any], pod: str) -> FailureKey:
    """The back-off key of this adapter generation on one agent."""
    meta = body["metadata"]
    return (meta.get("uid", ""), int(meta.get("generation", 0)), pod)


async def list_registries(rt: Runtime, view: FleetView, *, fresh: bool = True) -> dict[str, Registry]:
    """ListAdapters on every dialable agent at once; each answer also ends the reservations
    it now accounts for (:class:`~lorafleet_operator.placement.Reservations`). Unless
    ``fresh``, an agent listed less than a drift interval ago by the same pod is not asked
    again: its last listing plus the reservations since says what it holds (placement in a
    handler; the drift check always lists afresh). Handlers that find no such listing share
    the one in flight for that pod (:class:`~lorafleet_operator.runtime.SharedCalls`): a
    thousand adapters created at once ask each agent once, not a thousand times. The
    listings returned are shared and read-only."""

    async def ask(agent: AgentPod) -> Listing:
        requested_at = time.monotonic()
        registry = await rt.agents.list_adapters(agent.endpoint, view.creds)
        rt.reservations.listed(agent.endpoint, requested_at)
        listing = Listing(requested_at, (agent.uid, agent.restarts), registry)
        newest = rt.registries.get(agent.endpoint)
        # Two listings of one agent may answer out of order (the drift check's and a
        # handler's): the one kept is the latest requested, which deletions trust.
        if newest is None or newest.requested_at <= requested_at:
            rt.registries[agent.endpoint] = listing
            rt.sent.listed(agent.endpoint, requested_at)
        return listing

    def recent(agent: AgentPod) -> Mapping[str, RegistryEntry] | None:
        cached = rt.registries.get(agent.endpoint)
        if (
            cached is not None
            and cached.life == (agent.uid, agent.restarts)
            and time.monotonic() - cached.requested_at < rt.settings.drift_interval_s
        ):
            return cached.entries
        return None

    async def listing(agent: AgentPod) -> Mapping[str, RegistryEntry]:
        if fresh:
            return (await ask(agent)).entries
        entries = recent(agent)
        if entries is not None:
            return entries
        life = (agent.uid, agent.restarts)
        return (await rt.listings.get((agent.endpoint, life), lambda: ask(agent))).entries

    dialable = view.dialable
    if not fresh:
        cached = _all_cached(dialable, recent)
        if cached is not None:
            return dict(cached)
    return await ask_each(dialable, listing)


def candidates(rt: Runtime, view: FleetView, registries: Mapping[str, Registry]) -> list[Candidate]:
    """The fleet's agents as placement sees them (what each holds: its registry, every
    namespace's names, plus the loads sent there and not yet listed)."""
    chosen = []
    failing = rt.failures.failing_pods()
    for agent in view.agents:
        info, registry = view.infos.get(agent.name), registries.get(agent.name)
        if not agent.dialable or not isinstance(info, AgentInfo) or not isinstance(registry, Mapping):
            chosen.append(Candidate(agent.name, agent.endpoint, agent.dialable, known=False))
            continue
        chosen.append(
            Candidate(
                agent.name,
                agent.endpoint,
                True,
                base_model=info.base_model,
                max_lora_rank=info.max_lora_rank,
                max_loaded_loras=info.max_loaded_loras,
                held=rt.reservations.held(agent.endpoint, registry),
                failing=agent.name in failing,
            )
        )
    return chosen


def demand(rt: Runtime, body: Mapping[str, Any]) -> Demand:
    """What placement needs of one LoraAdapter: its spec's wants, its last placement (the
    status) and the agents that refused this generation (the back-off book)."""
    meta, spec = body["metadata"], body["spec"]
    uid, generation = meta.get("uid", ""), int(meta.get("generation", 0))
    last = ((body.get("status") or {}).get("placement") or {}).get("placed") or []
    refused = frozenset(
        pod
        for (key_uid, key_gen, pod), entry in rt.failures.entries.items()
        if key_uid == uid and key_gen == generation and entry.result.state is AgentState.FAILED
    )
    replicas, rank = spec.get("replicas"), spec.get("rank")
    return Demand(
        names.agent_name(meta["namespace"], meta["name"]),
        spec["baseModel"],
        None if replicas is None else int(replicas),
        None if rank is None else int(rank),
        (str(meta.get("creationTimestamp", "")), meta["name"]),
        tuple(last),
        refused,
    )


def place_fleet(
    rt: Runtime, view: FleetView, registries: Mapping[str, Registry], bodies: Sequence[Mapping[str, Any]], *, complete: bool
) -> dict[str, Placement]:
    """Place these adapters of the fleet in creation order (older adapters take room first).

    ``complete``: ``bodies`` are all of the fleet's live adapters (the drift check). Otherwise
    (a handler) they are placed after the fleet's adapters still waiting for room (the book
    the last drift check and handlers left), so a new adapter cannot take room an older one
    waits for; adapters that have their places need no new room and are not placed again.
    Synchronous: decisions of concurrent reconciles never interleave, and each sees the
    others' loads as reservations."""
    key = (view.namespace, view.name)
    fresh = {d.name: d for d in (demand(rt, b) for b in bodies)}
    book = rt.demands.setdefault(key, {})
    placements = place(candidates(rt, view, registries), fresh.values() if complete else {**book, **fresh}.values())
    if complete:
        book.clear()
    for name, placement in placements.items():
        if placement.waiting:
            book[name] = fresh.get(name) or book[name]
        else:
            book.pop(name, None)
    return placements


def placed_targets(view: FleetView, placement: Placement) -> list[Target]:
    """The placed agents as load targets (a Ready pod whose Describe failed stays a target
    that does not hold the adapter)."""
    chosen = []
    for agent in view.dialable:
        if agent.name not in placement.placed:
            continue
        info = view.infos.get(agent.name)
        if isinstance(info, AgentInfo):
            chosen.append(Target(agent, info))
        elif isinstance(info, AgentError):
            chosen.append(Target(agent, None, info))
    return chosen


async def place_and_load(rt: Runtime, view: FleetView, body: Mapping[str, Any]) -> tuple[Placement, list[AgentResult]]:
    """Place the adapter (with the fleet's others, oldest first) and load it on every placed
    agent at once (:func:`load_each`); one result per placed agent. With ``replicas``, the
    places of agents that refused it go to other agents at once, in a second round (placement
    keeps a refusing agent only when nothing else fits), not at the next drift check. Raises
    the credential's refusal when no agent serves the adapter (:func:`credential_refusal`)."""
    registries = await list_registries(rt, view, fresh=False)
    meta = body["metadata"]
    name = names.agent_name(meta["namespace"], meta["name"])
    placement = place_fleet(rt, view, registries, [body], complete=False)[name]
    credential = await adapter_credential(rt, view, body)
    results = await load_each(rt, view, placed_targets(view, placement), body, credential)
    if placement.replicas is not None and any(r.state is AgentState.FAILED for r in results):
        # Placed where it was just placed (stable), less the agents that refused it.
        placed = {**body, "status": {**(body.get("status") or {}), "placement": {"placed": list(placement.placed)}}}
        again = place_fleet(rt, view, registries, [placed], complete=False)[name]
        new = [t for t in placed_targets(view, again) if t.agent.name not in placement.placed]
        if new:
            done = {r.pod: r for r in results}
            done.update((r.pod, r) for r in await load_each(rt, view, new, body, credential))
            placement = again
            results = [done[t.agent.name] for t in placed_targets(view, again)]
    refusal = credential_refusal(credential, results)
    if refusal is not None:
        raise refusal
    return placement, results


async def load_each(
    rt: Runtime, view: FleetView, targets: Sequence[Target], body: Mapping[str, Any], credential: CredentialOutcome
) -> list[AgentResult]:
    """Load on every target at once (replace=True: the spec is the truth for managed names),
    unless a target's load is not to be sent (:func:`unsent`), their download progress in the
    Ready condition while the loads run (:func:`progress.reporting`): the one path of the
    handlers' loads and the drift check's repairs. A load of a local source waits in its
    agent's queue (``rt.loads``: a future, not a suspended call); a remote one (bounded per
    agent and namespace, apart) and a pinned one (under the agent's pin lock) are calls of
    their own. Outcomes in the targets' order; a failed load the agent answered also says
    which version the agent still serves."""
    async with progress.reporting(rt, view, targets, body):
        pending = [_start_load(rt, view, t, body, credential) for t in targets]
        futures = [p for p in pending if isinstance(p, asyncio.Future)]
        try:
            if futures:
                await asyncio.wait(futures)
        except asyncio.CancelledError:  # as gather would: the loads go with their caller
            for future in futures:
                future.cancel()
            raise
        for future in futures:
            future.exception()  # every one retrieved: the first error is raised below
        return [p if isinstance(p, AgentResult) else p.result() for p in pending]


def _start_load(
    rt: Runtime, view: FleetView, target: Target, body: Mapping[str, Any], credential: CredentialOutcome
) -> AgentResult | asyncio.Future[AgentResult]:
    """One target's load, started: its result when none is sent, else its future."""
    result = unsent(rt, target, body, credential)
    if result is not None:
        return result
    assert not isinstance(credential, FleetProblem)  # unsent() answered for a refusal
    if body["spec"].get("pinned"):
        return asyncio.ensure_future(load_pinned(rt, view, target, body, credential))
    _sending(rt, target, body)
    if sources.is_remote(str(body["spec"]["source"]["uri"])):
        return asyncio.ensure_future(_load(rt, view, target, body, credential))
    return rt.loads.submit(target.agent.endpoint, QueuedLoad(view, target, body, credential), lambda: _never_sent(rt, target, body))


def retry_due_in(rt: Runtime, body: Mapping[str, Any], results: Sequence[AgentResult]) -> float | None:
    """Seconds until the first failed agent of this adapter is due again (the back-off)."""
    return rt.failures.due_in(failure_key(body, r.pod) for r in results if not r.ok)


@dataclass(frozen=True)
class UnloadOutcome:
    """One agent's part of a deletion: done (``failure`` None), or how it failed."""

    pod: str
    failure: AgentFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def message(self) -> str:
        return "" if self.failure is None else failure_message(self.failure, "unload failed")


def unload_message(outcomes: Sequence[UnloadOutcome]) -> str:
    """The agents a deletion could not unload from, and their errors merged failure-first
    (the one rule); "" when every agent is done."""
    if not outcomes:
        return ""
    merged = merge_failure_first(outcomes, ok=lambda o: o.ok, error=lambda o: o.message)
    if merged.ok:
        return ""
    return f"not unloaded from {', '.join(o.pod for o in outcomes if not o.ok)}: {merged.error}"


def may_hold(rt: Runtime, agent: AgentPod, name: str) -> bool:
    """Whether the agent may hold this registry name. It does not when its last registry
    listing, by this pod life, lacks the name and was requested after every load of the name
    this process sent there ended answered (:class:`~lorafleet_operator.runtime.SentLoads`).
    An agent never listed, listed by another pod life (restarted, replaced), with such a load
    since its listing, or one that may still run there, may hold it."""
    listing = rt.registries.get(agent.endpoint)
    if listing is None or listing.life != (agent.uid, agent.restarts) or name in listing.entries:
        return True
    return not rt.sent.settled_by(agent.endpoint, name, listing.requested_at)


async def unload_from_holders(rt: Runtime, view: FleetView, agent_name: str) -> list[UnloadOutcome]:
    """Unload from every dialable agent of the fleet that may hold the adapter
    (:func:`may_hold`), whatever its model (the spec may have changed since the load); one
    outcome per agent asked. With ``replicas: 4`` of 64 agents that is about 4 unloads, not
    64. An agent that does not hold it after all counts as done. A stray this misses (a load
    another process sent, one by hand) is a managed name no live resource wants: the drift
    check unloads it. The unloads wait in their agents' queues
    (:meth:`~lorafleet_operator.agent_client.AgentClients.unload_each`), so a thousand
    deletions at once hold a future per agent each, not a suspended call."""
    agents = [a for a in view.dialable if may_hold(rt, a, agent_name)]
    for agent in agents:
        rt.reservations.finished(agent.endpoint, agent_name, time.monotonic(), loaded=False)
    unloads = rt.agents.unload_each([(a.endpoint, view.creds, agent_name) for a in agents])
    if departed_holders(rt, view, agent_name):
        answers, _ = await asyncio.gather(unloads, unload_departed(rt, view, agent_name))
    else:  # the common case: no task besides the deletion's own (gather makes one each)
        answers = await unloads
    return [UnloadOutcome(agent.name, unload_failure(answer)) for agent, answer in zip(agents, answers, strict=True)]


def departed_holders(rt: Runtime, view: FleetView, name: str) -> list[str]:
    """Endpoints outside the fleet's dialable agents that may still hold the registry name:
    this process's newest listing there has it, or a load of it sent there is not yet
    settled by a listing. Their pods went away or stopped being ready since; the agent
    processes behind them may still run (a namespace being deleted loses its pods before its
    adapters; agents serving several namespaces keep running)."""
    here = {a.endpoint for a in view.dialable}
    listed = {e for e, listing in rt.registries.items() if name in listing.entries}
    sent = {e for e, book in rt.sent.ends.items() if name in book}
    return sorted((listed | sent) - here)


async def unload_departed(rt: Runtime, view: FleetView, name: str) -> None:
    """Unload the name from its :func:`departed_holders`, best effort: waited for at most one
    call deadline and never holding the deletion (a pod that is gone may leave an address
    nobody answers at; the queued unloads go on after the wait). A bearer token goes there
    only after a fresh identity proof (:mod:`~lorafleet_operator.identity`), or over the
    fleet's verified TLS: the address may be another pod's by now."""
    endpoints = departed_holders(rt, view, name)
    if not endpoints:
        return
    for endpoint in endpoints:
        # No longer an agent pod this process watches there: the token goes only to an agent
        # that proves again it holds it (a reused IP's new pod gets the challenge, no token).
        rt.agents.identities.forget(endpoint)
    try:
        answers = await asyncio.wait_for(rt.agents.unload_each([(e, view.creds, name) for e in endpoints]), rt.settings.call_deadline_s)
    except TimeoutError:
        log.info(
            "unload of %s from %s (pods gone or not ready): no answer within %.0fs; left to run",
            name,
            ", ".join(endpoints),
            rt.settings.call_deadline_s,
        )
        return
    for endpoint, answer in zip(endpoints, answers, strict=True):
        failure = unload_failure(answer)
        if failure is None:
            log.info("unloaded %s from %s (pod gone or not ready)", name, endpoint)
        else:
            log.info("unload of %s from %s (pod gone or not ready) failed: %s", name, endpoint, failure_message(failure, "unload failed"))


def unload_failure(answer: ControlReply | AgentError) -> AgentFailure | None:
    """How an unload failed (None: done; an agent that does not hold the name counts as
    done)."""
    if isinstance(answer, AgentError):
        return None if answer.code == grpc.StatusCode.NOT_FOUND else answer
    return None if answer.success else answer
