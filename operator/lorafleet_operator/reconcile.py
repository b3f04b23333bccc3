"""The core of reconciliation, shared by the kopf handlers and the drift check.

A :class:`FleetView` is one look at a fleet: its agent pods, what each agent says it is
(Describe), and the credentials to reach them. Loads and unloads fan out over the target agents
concurrently (bounded in :mod:`agent_client`), and every agent's outcome becomes an
:class:`~lorafleet_operator.status.AgentResult`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from kubernetes.client.exceptions import ApiException

from lorafleet_common.merge import merge_failure_first
from lorafleet_operator import names
from lorafleet_operator.agent_client import AgentError, AgentInfo, ControlReply, Credentials
from lorafleet_operator.failures import (
    AdapterGeneration,
    AgentFailure,
    FailureKey,
    FleetProblem,
    agent_state,
    bearer_token,
    crash_verdict,
    died_under,
    failure_message,
    incarnation,
)
from lorafleet_operator.fleet import AgentPod, agents_of, selector_string
from lorafleet_operator.kube import SecretData
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.status import AgentResult, AgentState

log = logging.getLogger(__name__)
T = TypeVar("T")

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

    @property
    def dialable(self) -> list[AgentPod]:
        return [a for a in self.agents if a.dialable]

    def targets(self, base_model: str) -> list[Target]:
        """Ready agents serving ``base_model``, plus ready agents whose model is unknown because
        Describe failed (counted as targets that do not hold the adapter: conservative)."""
        chosen = []
        for agent in self.dialable:
            info = self.infos.get(agent.name)
            if isinstance(info, AgentInfo):
                if info.base_model == base_model:
                    chosen.append(Target(agent, info))
            elif isinstance(info, AgentError):
                chosen.append(Target(agent, None, info))
        return chosen


def opened_to(secret: SecretData, fleet: str) -> bool:
    """Whether the Secret's owner opened it to this fleet (:data:`ALLOW_LABEL` "true" or the
    fleet's name, or :data:`ALLOW_ANNOTATION` naming the fleet)."""
    if secret.labels.get(ALLOW_LABEL) in ("true", fleet):
        return True
    allowed = secret.annotations.get(ALLOW_ANNOTATION, "")
    return fleet in {n.strip() for n in allowed.split(",") if n.strip()}


async def opened_secret(rt: Runtime, namespace: str, fleet: str, name: str,
                        keys: Sequence[str]) -> Mapping[str, bytes]:
    """The data of a Secret the fleet may use: opened to it by its owner and holding ``keys``.

    Anything else — missing, not readable by the operator, not opened, a key missing — is
    refused with one and the same message, which says nothing about the Secret: a fleet's
    author learns no more than they wrote (the confused-deputy rule, docs/operator.md
    "Security"). Other API errors (the server down or busy) are transient and escape."""
    refused = FleetProblem(
        SECRET_NOT_OPENED,
        f"LoraFleet {fleet!r} may not use Secret {name!r} with key(s) "
        f"{', '.join(repr(k) for k in keys)}: the operator uses only Secrets of this namespace "
        f"that their owner opened to lorafleet (label {ALLOW_LABEL}=\"true\" or the fleet's "
        f"name, or annotation {ALLOW_ANNOTATION} naming the fleet) and that hold the named key(s)")
    try:
        secret = await rt.kube.get_secret(namespace, name)
    except ApiException as err:
        if err.status in (403, 404):
            raise refused from None
        raise
    if not opened_to(secret, fleet) or any(k not in secret.data for k in keys):
        raise refused
    return secret.data


async def credentials(rt: Runtime, namespace: str, fleet: str,
                      spec: Mapping[str, Any]) -> Credentials:
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
    return Credentials(token=token, root_ca=data["ca.crt"], client_cert=data.get("tls.crt"),
                       client_key=data.get("tls.key"), server_name=tls.get("serverName", ""))


async def ask_each(agents: Sequence[AgentPod],
                   call: Callable[[AgentPod], Awaitable[T]]) -> dict[str, T | AgentError]:
    """``call`` on every agent at once; by pod name, its answer or the AgentError it raised."""

    async def one(agent: AgentPod) -> T | AgentError:
        try:
            return await call(agent)
        except AgentError as err:
            return err

    answers = await asyncio.gather(*(one(a) for a in agents))
    return {a.name: answer for a, answer in zip(agents, answers, strict=True)}


async def describe_all(rt: Runtime, agents: Sequence[AgentPod], creds: Credentials,
                       *, fresh: bool) -> dict[str, AgentInfo | AgentError]:
    """Describe every dialable agent (cached per pod incarnation unless ``fresh``)."""

    async def describe(agent: AgentPod) -> AgentInfo:
        key = (agent.uid, agent.restarts, agent.endpoint)
        if fresh or key not in rt.describe_cache:
            rt.describe_cache[key] = await rt.agents.describe(agent.endpoint, creds)
        return rt.describe_cache[key]

    return await ask_each([a for a in agents if a.dialable], describe)


async def fleet_view(rt: Runtime, namespace: str, fleet_name: str, *,
                     fresh: bool = False, terminating_ok: bool = False) -> FleetView:
    """Look at a fleet now. Raises FleetProblem when it is missing or unusable, or being deleted
    (unless ``terminating_ok``: unloads still reach the agents of a fleet being deleted)."""
    fleet = await rt.kube.get_fleet(namespace, fleet_name)
    if fleet is None:
        raise FleetProblem("FleetNotFound", f"LoraFleet {fleet_name!r} not found in {namespace}")
    if fleet["metadata"].get("deletionTimestamp") and not terminating_ok:
        raise FleetProblem(FLEET_DELETED, f"LoraFleet {fleet_name!r} is being deleted: its "
                                          f"adapters are unloaded from its agents")
    spec = fleet.get("spec") or {}
    pods = await rt.kube.list_pods(namespace, selector_string(spec.get("selector") or {}))
    agents = agents_of(spec, pods)
    rt.crashes.observe(agents)  # a restart since a load that ended unanswered is a crash
    creds = await credentials(rt, namespace, fleet_name, spec)
    infos = await describe_all(rt, agents, creds, fresh=fresh)
    return FleetView(namespace, tuple(agents), infos, creds)


def loaded_result(target: Target, reply: ControlReply) -> AgentResult:
    """A target that holds the adapter after a successful load reply."""
    total = target.ranks_total or reply.ranks_reported
    ranks = reply.ranks_ok if reply.ranks_reported else total
    return AgentResult(target.agent.name, AgentState.LOADED, ranks, total)


def error_result(target: Target, failure: AgentFailure) -> AgentResult:
    """A target whose call failed: Unreachable or Failed as the policy classifies it."""
    return AgentResult(target.agent.name, agent_state(failure), 0, target.ranks_total,
                       failure_message(failure, "the agent refused the adapter"))


def generation_key(body: Mapping[str, Any]) -> AdapterGeneration:
    """What a crash during a load counts against: this adapter generation."""
    meta = body["metadata"]
    return (meta.get("uid", ""), int(meta.get("generation", 0)))


def condemned(rt: Runtime, body: Mapping[str, Any]) -> str:
    """Why this adapter generation is sent to no agent ("" while it may be loaded)."""
    return crash_verdict(rt.crashes, generation_key(body), body.get("status"))


async def load_on(rt: Runtime, view: FleetView, target: Target,
                  body: Mapping[str, Any]) -> AgentResult:
    """LoadAdapter on one target (replace=True: the spec is the truth for managed names),
    unless the generation is condemned; the outcome is booked in the crash book."""
    verdict = condemned(rt, body)
    if verdict:
        return AgentResult(target.agent.name, AgentState.FAILED, 0, target.ranks_total, verdict)
    if target.error is not None:
        return error_result(target, target.error)
    spec, meta = body["spec"], body["metadata"]
    key, pod = generation_key(body), target.agent.name
    try:
        reply = await rt.agents.load(
            target.agent.endpoint, view.creds,
            name=names.agent_name(meta["namespace"], meta["name"]),
            source_uri=spec["source"]["uri"], sha256=spec["source"].get("sha256", ""),
            pinned=bool(spec.get("pinned", False)), replace=True,
            exclusive=rt.crashes.isolate(key))
    except AgentError as err:
        if died_under(err):
            rt.crashes.suspect(key, pod, incarnation(target.agent), alone=err.alone,
                               message=err.message)
        else:
            rt.crashes.answered(key, pod, loaded=False)
        return error_result(target, err)
    rt.crashes.answered(key, pod, loaded=reply.success)
    return loaded_result(target, reply) if reply.success else error_result(target, reply)


def failure_key(body: Mapping[str, Any], pod: str) -> FailureKey:
    """The slow-retry key of this adapter generation on one agent."""
    meta = body["metadata"]
    return (meta.get("uid", ""), int(meta.get("generation", 0)), pod)


def remember_failures(rt: Runtime, body: Mapping[str, Any],
                      results: Sequence[AgentResult]) -> None:
    """Schedule slow retries for permanent failures; forget those that now succeeded."""
    for result in results:
        rt.failures.remember(failure_key(body, result.pod), result)


async def load_everywhere(rt: Runtime, view: FleetView,
                          body: Mapping[str, Any]) -> list[AgentResult]:
    """Load on every target agent at once; one result per target."""
    targets = view.targets(body["spec"]["baseModel"])
    results = list(await asyncio.gather(*(load_on(rt, view, t, body) for t in targets)))
    remember_failures(rt, body, results)
    return results


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


async def unload_everywhere(rt: Runtime, view: FleetView, agent_name: str) -> list[UnloadOutcome]:
    """Unload from every dialable agent of the fleet, whatever its model (the spec may have
    changed since the load). An agent that does not hold the adapter counts as done."""

    async def one(agent: AgentPod) -> UnloadOutcome:
        try:
            reply = await rt.agents.unload(agent.endpoint, view.creds, agent_name)
        except AgentError as err:
            return UnloadOutcome(agent.name, None if err.code == grpc.StatusCode.NOT_FOUND else err)
        return UnloadOutcome(agent.name, None if reply.success else reply)

    return list(await asyncio.gather(*(one(a) for a in view.dialable)))
