"""The pod's own web identity as the agent's S3 credential (EKS IRSA, or any cluster whose
service-account tokens an STS trusts): the token Kubernetes projects into the pod
(``AWS_WEB_IDENTITY_TOKEN_FILE``) is exchanged for temporary credentials of a role
(``AWS_ROLE_ARN``) at the fleet owner's STS endpoint (``--s3-sts-endpoint``, never a request's)
with ``AssumeRoleWithWebIdentity``, an unsigned call: the token is the proof.

The token file is read at every exchange (the kubelet rotates it); the credentials are kept until
shortly before they expire, and one exchange serves every load that needs it meanwhile. The STS
endpoint is reached like a download: every address checked against the SSRF rules
(`connect_checked`, ``--allow-source-network``), no environment proxy, no redirect followed,
the answer capped. The token travels in the POST body only and is never logged or repeated;
of a refusal, only the HTTP status and STS's error code are shown (its message is logged, with
the token cut out).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from pathlib import Path
from urllib.parse import urlencode, urlsplit
from xml.etree import ElementTree

from node_agent.errors import InvalidRequest, SourceRefused, SourceUnavailable
from node_agent.sources.connections import connect_checked
from node_agent.sources.credentials import S3Credential
from node_agent.sources.policy import DEFAULT_SOCKET_TIMEOUT_S, Network, check_endpoint_url

log = logging.getLogger(__name__)

WEB_IDENTITY_FLAG = "--s3-web-identity"
STS_ENDPOINT_FLAG = "--s3-sts-endpoint"
TOKEN_FILE_VARIABLE = "AWS_WEB_IDENTITY_TOKEN_FILE"
ROLE_ARN_VARIABLE = "AWS_ROLE_ARN"
SESSION_NAME_VARIABLE = "AWS_ROLE_SESSION_NAME"
DEFAULT_SESSION_NAME = "lorafleet-agent"
# Credentials are exchanged again this long before they expire, so that no download starts with
# credentials about to lapse.
REFRESH_MARGIN_S = 300.0
_MAX_TOKEN_BYTES = 64 << 10
_MAX_ANSWER_BYTES = 64 << 10
_SESSION_NAME = re.compile(r"^[\w+=,.@-]{2,64}$")
_ROLE_ARN = re.compile(r"^arn:[!-~]{1,2040}$")
_ERROR_CODE = re.compile(r"^[A-Za-z0-9.]{1,64}$")


def default_sts_endpoint(region: str) -> str:
    """AWS's regional STS endpoint for `region`, where the role lives when the store is AWS S3."""
    return f"https://sts.{region}.amazonaws.com"


@dataclass(frozen=True)
class WebIdentity:
    """Where the pod's identity is and what it becomes: the projected token's file, the role it
    assumes, the STS endpoint that exchanges it and the session's name; with the networks and
    socket timeout the exchange's connections are held to (as downloads' are)."""

    token_file: Path
    role_arn: str
    sts_endpoint: str
    session_name: str = DEFAULT_SESSION_NAME
    networks: tuple[Network, ...] = ()
    timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S

    def __post_init__(self) -> None:
        check_endpoint_url(self.sts_endpoint, STS_ENDPOINT_FLAG)
        if not _ROLE_ARN.match(self.role_arn):
            raise ValueError(f"{ROLE_ARN_VARIABLE} must be a role ARN (arn:..., printable ASCII without spaces)")
        if not _SESSION_NAME.match(self.session_name):
            raise ValueError(f"{SESSION_NAME_VARIABLE} must be 2 to 64 of letters, digits and +=,.@_-")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], sts_endpoint: str, networks: Sequence[Network] = ()) -> WebIdentity:
        """The identity the pod was given (EKS's webhook, or the chart, sets these variables);
        ValueError naming what is missing or invalid."""
        token_file, role_arn = environ.get(TOKEN_FILE_VARIABLE, ""), environ.get(ROLE_ARN_VARIABLE, "")
        if not token_file or not role_arn:
            raise ValueError(
                f"{WEB_IDENTITY_FLAG} needs {TOKEN_FILE_VARIABLE} and {ROLE_ARN_VARIABLE} in the environment "
                "(EKS sets both for a service account annotated eks.amazonaws.com/role-arn)"
            )
        session_name = environ.get(SESSION_NAME_VARIABLE) or DEFAULT_SESSION_NAME
        return cls(Path(token_file), role_arn, sts_endpoint, session_name, tuple(networks))


@dataclass(frozen=True)
class _Session:
    """Temporary credentials and when they expire (seconds since the epoch)."""

    credential: S3Credential
    expires_at: float


class WebIdentityCredentials:
    """The agent's S3 credential from the pod's web identity: exchanged at STS when first needed
    and again shortly before it expires. Safe to share between threads: concurrent loads wait on
    one exchange."""

    def __init__(self, identity: WebIdentity, clock: Callable[[], float] = time.time) -> None:
        self.identity = identity
        self._clock = clock
        self._lock = threading.Lock()
        self._session: _Session | None = None

    def __repr__(self) -> str:
        return f"WebIdentityCredentials({self.identity.role_arn} via {self.identity.sts_endpoint})"

    def current(self) -> S3Credential:
        """Credentials valid for a while yet; SourceRefused when STS refuses the identity,
        SourceUnavailable when it cannot be reached (nothing is kept of a failed exchange)."""
        with self._lock:
            if self._session is None or self._clock() >= self._session.expires_at - REFRESH_MARGIN_S:
                self._session = assume_role_with_web_identity(self.identity)
                log.info("web identity: credentials for %s until %s", self.identity.role_arn, _utc(self._session.expires_at))
            return self._session.credential


def assume_role_with_web_identity(identity: WebIdentity) -> _Session:
    """One exchange of the token file's current token for the role's temporary credentials."""
    token = _read_token(identity.token_file)
    form = {
        "Action": "AssumeRoleWithWebIdentity",
        "Version": "2011-06-15",
        "RoleArn": identity.role_arn,
        "RoleSessionName": identity.session_name,
        "WebIdentityToken": token,
    }
    status, answer = _post(identity, urlencode(form).encode("ascii"))
    if status != 200:
        raise _refusal(identity, status, answer, token)
    return _session_of(answer, identity)


def _read_token(path: Path) -> str:
    """The projected token, read now (it rotates); SourceRefused that never shows its content."""
    try:
        with path.open("rb") as file:
            data = file.read(_MAX_TOKEN_BYTES + 1)
    except OSError as error:
        raise SourceRefused(f"the web identity token file {path} cannot be read: {error.strerror}", "web_identity") from None
    token = data.decode("ascii", errors="replace").strip()
    if not token or len(data) > _MAX_TOKEN_BYTES or not all(" " < c <= "~" for c in token):
        raise SourceRefused(f"the web identity token file {path} does not hold one token (printable ASCII, at most 64 KiB)", "web_identity")
    return token


class _CheckedHTTPConnection(HTTPConnection):
    """A connection to checked addresses only (`connect_checked`); the host name stays the
    connection's, for ``Host`` and TLS SNI."""

    def __init__(self, host: str, port: int | None, *, networks: Sequence[Network], timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._create_connection = functools.partial(connect_checked, networks=networks)


class _CheckedHTTPSConnection(_CheckedHTTPConnection, HTTPSConnection):
    """The same over TLS (the default context: certificates and host names verified)."""


def _post(identity: WebIdentity, body: bytes) -> tuple[int, bytes]:
    """POST the form to the STS endpoint; its status and (capped) body. No redirect is followed."""
    parts = urlsplit(identity.sts_endpoint)
    kind = _CheckedHTTPSConnection if parts.scheme == "https" else _CheckedHTTPConnection
    connection = kind(parts.hostname or "", parts.port, networks=identity.networks, timeout=identity.timeout_s)
    headers = {"Content-Type": "application/x-www-form-urlencoded; charset=utf-8", "Accept": "application/xml"}
    try:
        connection.request("POST", parts.path or "/", body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read(_MAX_ANSWER_BYTES + 1)
    except (OSError, HTTPException) as error:
        raise SourceUnavailable(f"the STS endpoint {identity.sts_endpoint} could not be reached: {type(error).__name__}") from None
    finally:
        connection.close()


def _refusal(identity: WebIdentity, status: int, answer: bytes, token: str) -> SourceRefused | SourceUnavailable:
    """STS's refusal as the agent's error: the status and STS's error code (its message only in
    the log, without the token)."""
    code, message = _error_of(answer)
    shown = message.replace(token, "***")[:500]
    log.warning("STS refused the web identity for %s: HTTP %d %s: %r", identity.role_arn, status, code, shown)
    what = f"the STS endpoint {identity.sts_endpoint} refused the pod's web identity for {identity.role_arn}: HTTP {status} {code}"
    if status >= 500 or status == 429:
        return SourceUnavailable(what.rstrip())
    return SourceRefused(what.rstrip(), "web_identity")


def _error_of(answer: bytes) -> tuple[str, str]:
    """An STS error answer's code (only when it looks like one) and message."""
    root = _parsed(answer)
    if root is None:
        return "", ""
    code = _text(root, "Code")
    return (code if _ERROR_CODE.match(code) else ""), _text(root, "Message")


def _session_of(answer: bytes, identity: WebIdentity) -> _Session:
    """The credentials of a successful answer; SourceRefused when it holds none."""
    root = _parsed(answer)
    credentials = _find(root, "Credentials") if root is not None else None
    if credentials is None:
        raise SourceRefused(f"the STS endpoint {identity.sts_endpoint} answered without credentials", "web_identity")
    try:
        expires = datetime.fromisoformat(_text(credentials, "Expiration"))
    except ValueError:
        raise SourceRefused(
            f"the STS endpoint {identity.sts_endpoint} answered credentials without a valid Expiration", "web_identity"
        ) from None
    try:
        credential = S3Credential(
            _text(credentials, "AccessKeyId"), _text(credentials, "SecretAccessKey"), _text(credentials, "SessionToken")
        )
    except InvalidRequest as error:  # an empty or unsendable value, not shown
        raise SourceRefused(
            f"the STS endpoint {identity.sts_endpoint} answered credentials that cannot be used: {error}", "web_identity"
        ) from None
    return _Session(credential, (expires if expires.tzinfo else expires.replace(tzinfo=UTC)).timestamp())


def _parsed(answer: bytes) -> ElementTree.Element | None:
    """The answer's XML document (None: not XML, or over the cap)."""
    if len(answer) > _MAX_ANSWER_BYTES:
        return None
    try:
        return ElementTree.fromstring(answer)
    except ElementTree.ParseError:
        return None


def _find(root: ElementTree.Element, name: str) -> ElementTree.Element | None:
    """The first element named `name` in any namespace (AWS's answers carry one; others may not)."""
    return next((element for element in root.iter() if element.tag.rpartition("}")[2] == name), None)


def _text(root: ElementTree.Element, name: str) -> str:
    element = _find(root, name)
    return (element.text or "").strip() if element is not None else ""


def _utc(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")
