"""The one rule for Secrets: the operator reads a Secret for a fleet only when its owner
opened it to that fleet; and the fleet's own token and TLS material, read under that rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kubernetes.client.exceptions import ApiException

from lorafleet_operator.agent_values import Credentials
from lorafleet_operator.failures import FleetProblem, bearer_token, kube_refused
from lorafleet_operator.kube import Kube, SecretData
from lorafleet_operator.reasons import Reason
from lorafleet_operator.resources import FleetSpec

#: A Secret's owner opens it to every LoraFleet of its namespace with this label ("true"),
#: or to one of them (the label's value is the fleet's name) ...
ALLOW_LABEL = "lorafleet.dev/allow-fleet"
#: ... or to some of them with this annotation: their names, comma-separated (fleet names may
#: be longer than a label value's 63 characters).
ALLOW_ANNOTATION = "lorafleet.dev/allowed-fleets"


def opened_to(secret: SecretData, fleet: str) -> bool:
    """Whether the Secret's owner opened it to this fleet (:data:`ALLOW_LABEL` "true" or the
    fleet's name, or :data:`ALLOW_ANNOTATION` naming the fleet)."""
    if secret.labels.get(ALLOW_LABEL) in ("true", fleet):
        return True
    allowed = secret.annotations.get(ALLOW_ANNOTATION, "")
    return fleet in {n.strip() for n in allowed.split(",") if n.strip()}


async def opened_secret(kube: Kube, namespace: str, fleet: str, name: str, keys: Sequence[str]) -> Mapping[str, bytes]:
    """The data of a Secret the fleet may use: opened to it by its owner and holding ``keys``.

    Anything else — missing, not readable by the operator, a read the API server refuses (a
    4xx: :func:`~lorafleet_operator.failures.kube_refused`), not opened, a key missing — is
    refused with one and the same message, which says nothing about the Secret: a fleet's
    author learns no more than they wrote (the confused-deputy rule, docs/operator.md
    "Security"); the refusal is the asking object's alone. Other API errors (the server down
    or busy) are transient and escape."""
    refused = FleetProblem(
        Reason.SECRET_NOT_OPENED,
        f"LoraFleet {fleet!r} may not use Secret {name!r} with key(s) "
        f"{', '.join(repr(k) for k in keys)}: the operator uses only Secrets of this namespace "
        f'that their owner opened to lorafleet (label {ALLOW_LABEL}="true" or the fleet\'s '
        f"name, or annotation {ALLOW_ANNOTATION} naming the fleet) and that hold the named key(s)",
    )
    try:
        secret = await kube.get_secret(namespace, name)
    except ApiException as err:
        if kube_refused(err):
            raise refused from None
        raise
    if not opened_to(secret, fleet) or any(k not in secret.data for k in keys):
        raise refused
    return secret.data


async def fleet_credentials(kube: Kube, namespace: str, fleet: str, spec: FleetSpec) -> Credentials:
    """The fleet's token and TLS material, read from Secrets opened to it (by name: no list
    rights). The token is trimmed and checked (:func:`~lorafleet_operator.failures.bearer_token`)."""
    token = ""
    if spec.token is not None:
        ref = spec.token
        token = bearer_token((await opened_secret(kube, namespace, fleet, ref.name, (ref.key,)))[ref.key])
    if spec.tls is None:
        return Credentials(token=token)
    data = await opened_secret(kube, namespace, fleet, spec.tls.secret, ("ca.crt",))
    return Credentials(
        token=token,
        root_ca=data["ca.crt"],
        client_cert=data.get("tls.crt"),
        client_key=data.get("tls.key"),
        server_name=spec.tls.server_name,
    )
