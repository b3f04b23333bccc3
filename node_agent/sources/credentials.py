"""What authenticates a download: `SourceCredential`, sent to the source's own URLs only, as an
unredirected header (never to a redirect target, such as the Hub's file CDN), never logged or
repeated; a value that cannot be a header is refused without showing it."""

from __future__ import annotations

import base64
from dataclasses import dataclass

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


def _check_header_safe(value: str, what: str) -> None:
    """Refuse an empty value or one with control or non-ASCII characters, without showing it
    (http.client would refuse it with the value in its message)."""
    if not value:
        raise InvalidRequest(f"{what} is empty")
    bad = sum(1 for c in value if not " " <= c <= "~")
    if bad:
        raise InvalidRequest(f"{what} cannot be sent as a header value: it contains {bad} control or non-ASCII character(s)")
