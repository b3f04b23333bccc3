"""The agent identity check: a fleet's token goes only to pods that prove they hold it already.

A pod the fleet's selector matches is not necessarily an agent: labels are anyone's to set.
Before the first token-bearing call to an endpoint, the client sends ``ProveIdentity`` (no
token) with a fresh 32-byte nonce and the pod's "NAMESPACE/NAME", and accepts the pod only when
the answer is HMAC-SHA256(token, CONTEXT || pod || 0x00 || nonce) (:mod:`lorafleet_common.identity`). A verified TLS
handshake (the fleet's ``spec.tls``: the agent's certificate checked against its CA) counts as
the proof instead, so no challenge is sent then.

Proofs are remembered per endpoint, for the pod (uid) last seen there and the token's digest:
a new pod at the endpoint (a reused IP) or a rotated token is asked again. A pod that fails is
refused with PERMISSION_DENIED (permanent: state Failed, the message says why, nothing is
sent to it), logged once, and reported once per pod by a Warning Event ``NotAnAgent``.
A challenge that cannot be delivered (the pod unreachable) is transient and retried.

The pod's name in the proof defeats a relay: a pod that passes the challenge on to a real
agent gets back a proof for that agent's pod only when the agent knows its own name
(``--pod-name``, set by the chart) and so refuses another's; an agent started without it (one
process behind several pods, as in local tests) answers for any pod.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import urllib3
from kubernetes.client.exceptions import ApiException

from lorafleet_common.identity import NONCE_BYTES, proof_matches
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.kube import Kube
from lorafleet_operator.reasons import EventReason

log = logging.getLogger(__name__)

#: ``AgentError.reason`` of a pod that did not prove it is an agent (and of a challenge that
#: could not be delivered: not the agent's answer, but no crash of a load either).
NOT_AN_AGENT = "not_an_agent"
IDENTITY_UNCHECKED = "identity_unchecked"
#: Codes with which a challenge never reached an answer: asking again may help.
UNDELIVERED = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)


def token_digest(token: str) -> str:
    """What a proof is remembered under (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def refusal(endpoint: str, why: str) -> str:
    """The message of a pod that did not prove it is an agent (its status entry, the Event)."""
    return f"the pod at {endpoint} did not prove it is a lorafleet agent holding the fleet's token ({why}): nothing was sent to it"


def check_answer(token: str, pod: str, nonce: bytes, proof: bytes) -> str:
    """Why the answer is no proof ("" when it is one)."""
    if not proof:
        return "it answered no proof: it holds no token, or it is another pod's agent"
    return "" if proof_matches(token, pod, nonce, proof) else "its proof does not match the token"


@dataclass
class Identities:
    """Which endpoints proved they hold which token, for which pod; pods already reported."""

    #: endpoint -> (uid, "NAMESPACE/NAME") of the pod last seen there (from the fleet's pods).
    pods: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: endpoint -> (pod uid, token digest) it proved.
    proven: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: pod uids a NotAnAgent Event was posted for.
    reported: set[str] = field(default_factory=set)
    #: (endpoint, token digest) refusals already logged.
    logged: set[tuple[str, str]] = field(default_factory=set)

    def observe(self, pods: Sequence[AgentPod]) -> None:
        """The pods now at these endpoints; a new pod at one must prove again."""
        for pod in pods:
            seen = (pod.uid, f"{pod.namespace}/{pod.name}")
            if self.pods.get(pod.endpoint) != seen:
                self.pods[pod.endpoint] = seen
                self.proven.pop(pod.endpoint, None)

    def pod_at(self, endpoint: str) -> str:
        """The "NAMESPACE/NAME" of the pod last seen at the endpoint ("" when none was)."""
        return self.pods.get(endpoint, ("", ""))[1]

    def is_proven(self, endpoint: str, token: str) -> bool:
        return self.proven.get(endpoint) == (self.pods.get(endpoint, ("", ""))[0], token_digest(token))

    def forget(self, endpoint: str) -> None:
        """The pod last seen at the endpoint may be gone and its IP another pod's now: the next
        token-bearing call there proves again (the challenge carries no token)."""
        self.proven.pop(endpoint, None)

    def prove(self, endpoint: str, token: str) -> None:
        self.proven[endpoint] = (self.pods.get(endpoint, ("", ""))[0], token_digest(token))

    def refused(self, endpoint: str, token: str, message: str) -> None:
        """Log a refusal once per endpoint and token."""
        key = (endpoint, token_digest(token))
        if key not in self.logged:
            self.logged.add(key)
            log.warning("%s", message)

    def first_report(self, uid: str) -> bool:
        """Whether this pod's refusal is to be reported now (once per pod)."""
        if uid in self.reported:
            return False
        self.reported.add(uid)
        return True


async def report_impostors(kube: Kube, identities: Identities, agents: Sequence[AgentPod], answers: Mapping[str, object]) -> None:
    """A Warning Event ``NotAnAgent`` on each pod whose answer (by pod name) is a refusal of
    this module, once per pod. Best effort: a failed Event post is logged, not raised."""
    for pod in agents:
        answer = answers.get(pod.name)
        if getattr(answer, "reason", "") != NOT_AN_AGENT or not identities.first_report(pod.uid):
            continue
        try:
            await kube.post_event(
                pod.namespace,
                {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "uid": pod.uid},
                "Warning",
                EventReason.NOT_AN_AGENT,
                str(getattr(answer, "message", "")),
            )
        except (ApiException, urllib3.exceptions.HTTPError) as err:
            log.warning("could not post the %s Event on pod %s/%s: %s", EventReason.NOT_AN_AGENT, pod.namespace, pod.name, err)
