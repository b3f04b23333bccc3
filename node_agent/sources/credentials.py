"""What authenticates a download: `SourceCredential`, sent to the source's own URLs only, as an
unredirected header (never to a redirect target, such as the Hub's file CDN), and
`S3Credential`, which signs s3:// requests; neither is ever logged or repeated, and a value
that cannot be a header is refused without showing it."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Protocol

from node_agent.errors import InvalidRequest


@dataclass(frozen=True)
class SourceCredential:
    """What authenticates a download: the ``Authorization`` header value sent to the source's own
    URLs. Its repr shows only the scheme, so no log line or traceback can carry the secret."""

    authorization: str

    def __repr__(self) -> str:
        return f"SourceCredential({self.authorization.partition(' ')[0]} ***)"

    @classmethod
    def bearer(cls, token: str) -> SourceCredential:
        """A bearer token (a Hub token, or any http(s) bearer token)."""
        _check_header_safe(token, "the source token")
        return cls(f"Bearer {token}")

    @classmethod
    def basic(cls, username: str, password: str) -> SourceCredential:
        """HTTP basic authentication (RFC 7617): a user name without ':' and a password."""
        if ":" in username:
            raise InvalidRequest("the source user name cannot contain ':' (HTTP basic authentication)")
        _check_header_safe(username, "the source user name")
        _check_header_safe(password, "the source password")
        return cls("Basic " + base64.b64encode(f"{username}:{password}".encode()).decode("ascii"))


@dataclass(frozen=True)
class S3Credential:
    """An S3 access key, its secret and an optional session token (temporary credentials), with
    which s3:// requests are signed (SigV4). Its repr shows only the access key id's first four
    characters."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        _check_header_safe(self.access_key_id, "the S3 access key id")
        _check_header_safe(self.secret_access_key, "the S3 secret access key")
        if self.session_token:
            _check_header_safe(self.session_token, "the S3 session token")

    def __repr__(self) -> str:
        return f"S3Credential({self.access_key_id[:4]}*** ***)"


class S3CredentialSource(Protocol):
    """Where the agent's own S3 credential comes from when it changes over time (the pod's web
    identity, `web_identity`): asked at each s3:// download."""

    def current(self) -> S3Credential:
        """A credential valid for a while yet (AgentError when none can be had now)."""
        ...


# What a load may carry to authenticate its source: a header credential (http(s), hf://, oci://)
# or an S3 credential (s3://).
Credential = SourceCredential | S3Credential


@dataclass(frozen=True)
class SourceAccess:
    """What a load brings for its source besides the URI: the credential that authenticates it,
    and the revision it must still resolve to (`resolve_source`; "" for any)."""

    credential: Credential | None = None
    revision: str = ""


def _check_header_safe(value: str, what: str) -> None:
    """Refuse an empty value or one with control or non-ASCII characters, without showing it
    (http.client would refuse it with the value in its message)."""
    if not value:
        raise InvalidRequest(f"{what} is empty")
    bad = sum(1 for c in value if not " " <= c <= "~")
    if bad:
        raise InvalidRequest(f"{what} cannot be sent as a header value: it contains {bad} control or non-ASCII character(s)")
