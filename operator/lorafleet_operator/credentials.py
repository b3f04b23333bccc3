"""A LoraAdapter's source credential: read from a Secret its spec names, sent with the load.

``spec.source.credentials`` = ``{type: Bearer | Basic | S3 | DockerConfigJson, secretRef: {name,
key}}``. ``Bearer`` (a Hub token for hf://, an http(s) bearer token, a registry's token for
oci://) reads ``secretRef.key`` (default ``token``); ``Basic`` reads the Secret's ``username`` and
``password`` keys (those of the ``kubernetes.io/basic-auth`` Secret type); ``S3`` (s3:// only)
reads ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and, when present, ``AWS_SESSION_TOKEN``
(the names the AWS tools read from the environment); ``DockerConfigJson`` (oci:// only) reads a
``kubernetes.io/dockerconfigjson`` Secret's entry for the source's registry
(`registry_credentials`). An s3:// source takes only ``S3``. The Secret is read only when it is opened to the
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

from lorafleet_common.sources import OCI_SCHEME, S3_SCHEME, scheme_of
from lorafleet_common.storage import InvalidStorageUri, parse_oci_uri
from lorafleet_operator.agent_values import S3AccessKey, SourceCredential
from lorafleet_operator.failures import FleetProblem
from lorafleet_operator.reasons import Reason
from lorafleet_operator.registry_credentials import DOCKER_CONFIG_KEY, NoRegistryLogin, registry_login
from lorafleet_operator.resources import FleetSpec, Source

BEARER, BASIC, S3, DOCKER_CONFIG = "Bearer", "Basic", "S3", "DockerConfigJson"
DEFAULT_TOKEN_KEY = "token"
BASIC_KEYS = ("username", "password")
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
S3_SESSION_TOKEN_KEY = "AWS_SESSION_TOKEN"
#: The one scheme each storage credential type is for (the others go with any remote source).
_SCHEME_OF_TYPE = {S3: S3_SCHEME, DOCKER_CONFIG: OCI_SCHEME}

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
    kind = _credential_type(source, ref.type or BEARER)
    if kind == S3:
        return await _s3_credential(ref.secret, read)
    if kind == DOCKER_CONFIG:
        return await _registry_credential(ref.secret, source.uri, read)
    if kind == BASIC:
        data = await read(ref.secret, BASIC_KEYS)
        return SourceCredential(username=_header_safe(data["username"], "username"), password=_header_safe(data["password"], "password"))
    key = ref.key or DEFAULT_TOKEN_KEY
    data = await read(ref.secret, (key,))
    return SourceCredential(token=_header_safe(data[key], "token"))


def _credential_type(source: Source, kind: str) -> str:
    """The credential's type, refused where the source's scheme does not take it: ``S3`` and
    ``DockerConfigJson`` belong to s3:// and oci://, and s3:// takes nothing but ``S3``."""
    scheme = scheme_of(source.uri)
    wanted = _SCHEME_OF_TYPE.get(kind)
    if (wanted is not None and scheme != wanted) or (scheme == S3_SCHEME and kind != S3):
        raise FleetProblem(
            Reason.SOURCE_CREDENTIAL_REFUSED,
            f"a {kind} credential does not go with a {scheme or 'schemeless'}:// source: s3:// sources take type {S3}, "
            f"{DOCKER_CONFIG} is for oci:// sources; not loaded",
        )
    return kind


async def _s3_credential(secret: str, read: SecretReader) -> SourceCredential:
    data = await read(secret, S3_KEYS)
    session = data.get(S3_SESSION_TOKEN_KEY)
    key = S3AccessKey(
        access_key_id=_header_safe(data[S3_KEYS[0]], "access key id"),
        secret_access_key=_header_safe(data[S3_KEYS[1]], "secret access key"),
        session_token=_header_safe(session, "session token") if session is not None else "",
    )
    return SourceCredential(s3=key)


async def _registry_credential(secret: str, uri: str, read: SecretReader) -> SourceCredential:
    """The user and password of the docker config's entry for the oci:// source's registry."""
    try:
        registry = parse_oci_uri(uri).registry
    except InvalidStorageUri as error:
        raise FleetProblem(Reason.SOURCE_CREDENTIAL_REFUSED, f"{error}; not loaded") from None
    data = await read(secret, (DOCKER_CONFIG_KEY,))
    try:
        username, password = registry_login(data[DOCKER_CONFIG_KEY], registry)
    except NoRegistryLogin as error:
        raise FleetProblem(Reason.SOURCE_CREDENTIAL_REFUSED, f"{error}; not loaded until the Secret is fixed") from None
    return SourceCredential(username=_header_safe(username.encode(), "username"), password=_header_safe(password.encode(), "password"))
