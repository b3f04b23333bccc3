"""A LoraAdapter's source credential: read from a Secret its spec names, sent with the load.

``spec.source.credentials`` = ``{type: Bearer | Basic, secretRef: {name, key}}``. ``Bearer``
(a Hub token for hf://, or an http(s) bearer token) reads ``secretRef.key`` (default
``token``); ``Basic`` reads the Secret's ``username`` and ``password`` keys (those of the
``kubernetes.io/basic-auth`` Secret type). The Secret is read only when it is opened to the
adapter's fleet, through the one rule for Secrets (``fleet_secrets.opened_secret``), which refuses
anything else with a message that says nothing about the Secret. Three more rules, here:

* the name must be a Kubernetes object name (a DNS-1123 subdomain, as the CRD requires): an
  object stored before the CRD said so, with a name like ``creds-b%2Fbob-src-token``, is
  refused without asking the API server;
* never the fleet's own agent Secrets (its token or TLS Secret): a tenant who may create
  LoraAdapters could otherwise have the fleet's token sent to a source host;
* only to fleets whose agents can prove who they are (``spec.auth``: the identity proof, or
  ``spec.tls``: the verified certificate); otherwise any pod the selector matches would get it.

The value is trimmed like the fleet's token and refused when it cannot be a header value; no
message, status or log line shows it (the dataclass's repr hides it).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence

from lorafleet_operator.agent_values import SourceCredential
from lorafleet_operator.failures import FleetProblem
from lorafleet_operator.reasons import Reason
from lorafleet_operator.resources import FleetSpec, Source

BEARER, BASIC = "Bearer", "Basic"
DEFAULT_TOKEN_KEY = "token"
BASIC_KEYS = ("username", "password")

#: A Secret's name: a DNS-1123 subdomain of at most 253 characters (the CRD's pattern).
SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
SECRET_NAME_MAX = 253

#: Reads an opened Secret's data by name, requiring the keys (``fleet_secrets.opened_secret``).
SecretReader = Callable[[str, Sequence[str]], Awaitable[Mapping[str, bytes]]]


def _header_safe(raw: bytes, what: str) -> str:
    """A Secret value as a header value: surrounding whitespace trimmed; empty, control or
    non-ASCII bytes refused (permanent), the message counting them, never showing them."""
    value = raw.strip(b" \t\r\n\f\v")
    bad = sum(1 for b in value if not 0x20 <= b <= 0x7E)
    if not value or bad:
        problem = "is empty" if not value else f"contains {bad} control or non-ASCII byte(s)"
        raise FleetProblem(
            Reason.SOURCE_CREDENTIAL_REFUSED,
            f"the source credential's {what} {problem} after trimming surrounding whitespace; not loaded until the Secret is fixed",
        )
    return value.decode("ascii")


async def source_credential(source: Source, fleet_name: str, fleet: FleetSpec, read: SecretReader) -> SourceCredential | None:
    """The adapter's source credential (None when its spec names none), read through ``read``;
    FleetProblem when the operator will not send it (see the module's rules)."""
    ref = source.credentials
    if ref is None:
        return None
    if len(ref.secret) > SECRET_NAME_MAX or not SECRET_NAME.fullmatch(ref.secret):
        raise FleetProblem(
            Reason.SOURCE_CREDENTIAL_REFUSED,
            f"Secret name {ref.secret!r} is not a Kubernetes object name (a DNS-1123 subdomain: "
            f"at most {SECRET_NAME_MAX} lowercase letters, digits, '-' and '.'); not loaded",
        )
    if ref.secret in fleet.agent_secrets:
        raise FleetProblem(
            Reason.SOURCE_CREDENTIAL_REFUSED,
            f"Secret {ref.secret!r} holds LoraFleet {fleet_name!r}'s own agent credentials: it is never sent to a source; not loaded",
        )
    if fleet.token is None and fleet.tls is None:
        raise FleetProblem(
            Reason.SOURCE_CREDENTIAL_REFUSED,
            f"LoraFleet {fleet_name!r} has neither "
            f"spec.auth nor spec.tls, so its agents "
            f"cannot prove who they are: source "
            f"credentials are sent only to agents "
            f"that can; not loaded",
        )
    if (ref.type or BEARER) == BASIC:
        data = await read(ref.secret, BASIC_KEYS)
        return SourceCredential(username=_header_safe(data["username"], "username"), password=_header_safe(data["password"], "password"))
    key = ref.key or DEFAULT_TOKEN_KEY
    data = await read(ref.secret, (key,))
    return SourceCredential(token=_header_safe(data[key], "token"))
