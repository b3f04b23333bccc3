"""The connections a download makes: only to addresses the policy allows, and redirects only to
allowed http(s) URLs.

Every connection resolves its host once, checks every address of the answer, and connects only
to an address it checked (the connection's ``create_connection`` does all three, so nothing can
change in between; TLS SNI and ``Host`` keep the name). Loopback, link-local (cloud metadata),
private, shared (100.64.0.0/10), unspecified, multicast and other non-global addresses are never
connected to unless they lie in ``allowed_networks`` (``--allow-source-network``). Environment
proxies are not used (through a proxy the agent could not check where it connects).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import urllib.request
from collections.abc import Sequence
from http.client import HTTPConnection, HTTPMessage, HTTPResponse, HTTPSConnection
from typing import IO, Any
from urllib.parse import urlsplit

from lorafleet_common.sources import SourcePrefix, redact_uri
from node_agent.errors import SourceRefused
from node_agent.sources.policy import ALLOW_NETWORK_FLAG, Network, check_allowed
from node_agent.sources.watchdog import Watchdog

log = logging.getLogger(__name__)

_SHARED_NETWORK = ipaddress.ip_network("100.64.0.0/10")


def address_class(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What kind of non-public address `ip` is (None: a global unicast address)."""
    for test, name in (
        ("is_unspecified", "unspecified"),
        ("is_loopback", "loopback"),
        ("is_link_local", "link-local (where cloud metadata services answer)"),
        ("is_multicast", "multicast"),
        ("is_site_local", "site-local"),
    ):
        if getattr(ip, test, False):
            return name
    if ip in _SHARED_NETWORK:
        return "shared (100.64.0.0/10, carrier-grade NAT)"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "reserved (not globally routable)"
    return None


_Answer = tuple[int, int, int, Any]  # (family, type, proto, sockaddr) of one getaddrinfo answer


def _allowed_answers(host: str, port: int, networks: Sequence[Network]) -> list[_Answer]:
    """The host's addresses the policy allows (resolved once); SourceRefused when none is."""
    allowed: list[_Answer] = []
    refused: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, str]] = []
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d is a.b.c.d
            ip = ip.ipv4_mapped
        why = address_class(ip)
        if why is not None and not any(ip.version == net.version and ip in net for net in networks):
            refused.append((ip, why))
        else:
            allowed.append((family, kind, proto, sockaddr))
    if refused:
        log.warning("download host %s: not connecting to %s", host, ", ".join(f"{ip} ({why})" for ip, why in refused))
    if not allowed:
        kinds = ", ".join(sorted({why for _, why in refused}))
        raise SourceRefused(
            f"the host {host!r} resolves only to addresses downloads may not connect to ({kinds}); "
            f"allow such networks with {ALLOW_NETWORK_FLAG} CIDR",
            "address_refused",
        )
    return allowed


def connect_checked(
    address: tuple[str, int],
    timeout: float | None = None,
    source_address: tuple[str, int] | None = None,
    *,
    networks: Sequence[Network],
) -> socket.socket:
    """`socket.create_connection`, but only to addresses the policy allows.

    The host is resolved once; every address of the answer is checked; only checked addresses
    are connected to (in the resolver's order), so no second lookup can answer differently.
    """
    host, port = address
    error: OSError | None = None
    for family, kind, proto, sockaddr in _allowed_answers(host, port, networks):
        sock = socket.socket(family, kind, proto)
        try:
            if timeout is not None:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as failed:
            sock.close()
            error = failed
    assert error is not None
    raise error


class _TrackedHTTPConnection(HTTPConnection):
    """A connection to checked addresses only (`connect_checked`) that hands its socket to the
    watchdog once connected. The host name stays the connection's: ``Host`` and TLS SNI use it."""

    def __init__(self, *args: Any, watchdog: Watchdog, networks: Sequence[Network], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watchdog = watchdog
        self._create_connection = functools.partial(connect_checked, networks=networks)

    def connect(self) -> None:
        super().connect()
        self._watchdog.track(self.sock)


class _TrackedHTTPSConnection(_TrackedHTTPConnection, HTTPSConnection):
    """The same over TLS: in this order `super()` above is HTTPSConnection, so the watchdog
    tracks the TLS socket, after the handshake (wrapping detaches the plain socket)."""


class _TrackedHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """http and https through tracked connections; being both, it replaces both default handlers."""

    def __init__(self, watchdog: Watchdog, networks: Sequence[Network]) -> None:
        super().__init__()
        self._http = functools.partial(_TrackedHTTPConnection, watchdog=watchdog, networks=networks)
        self._https = functools.partial(_TrackedHTTPSConnection, watchdog=watchdog, networks=networks)

    def http_open(self, req: urllib.request.Request) -> HTTPResponse:
        return self.do_open(self._http, req)

    def https_open(self, req: urllib.request.Request) -> HTTPResponse:
        return self.do_open(self._https, req)


class HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s) URLs without credentials (urllib allows ftp:// and file://)
    and under an allowed source prefix; the target is not repeated (it is the server's content)."""

    def __init__(self, prefixes: Sequence[SourcePrefix]) -> None:
        super().__init__()
        self._prefixes = prefixes
        self.hops: list[HTTPMessage] = []  # the headers of every redirect answered (the Hub's commit)

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> urllib.request.Request | None:
        try:
            target = urlsplit(newurl)
        except ValueError:
            target = urlsplit("invalid:")
        what = f"redirect from {redact_uri(req.full_url)} refused"
        if target.scheme.lower() not in ("http", "https"):
            raise SourceRefused(f"{what}: the target is not an http(s) URL", "redirect")
        if "@" in target.netloc:
            raise SourceRefused(f"{what}: credentials in URLs are refused", "redirect")
        check_allowed(newurl, self._prefixes, what=f"{what}: the target")
        self._check_loop(req, newurl, what)
        self.hops.append(headers)
        # The token was added as an unredirected header: urllib does not carry it to the target.
        follow = super().redirect_request(req, fp, code, msg, headers, newurl)
        if follow is not None and req.get_method() == "HEAD":
            follow.method = "HEAD"  # urllib follows a HEAD with a GET: a download where none was asked
        return follow

    def _check_loop(self, req: urllib.request.Request, newurl: str, what: str) -> None:
        """urllib's own loop rule (a target redirected to `max_repeats` times already, or
        `max_redirections` hops), checked first so the refusal says what it is; urllib would
        answer with the last redirect's status. The target may be named: it is under an allowed
        prefix (checked above) and the agent has already fetched it."""
        visited: dict[str, int] = getattr(req, "redirect_dict", {})
        if visited.get(newurl, 0) >= self.max_repeats:
            raise SourceRefused(
                f"{what}: a redirect loop ({redact_uri(newurl)} was redirected to {visited[newurl]} times already)", "redirect"
            )
        if len(visited) >= self.max_redirections:
            raise SourceRefused(f"{what}: more than {self.max_redirections} redirects (the limit)", "redirect")


def build_opener(watchdog: Watchdog, networks: Sequence[Network], redirects: HttpOnlyRedirects) -> urllib.request.OpenerDirector:
    """An opener whose every connection is the agent's own, checked and watched: no
    ProxyHandler with environment proxies, only checked addresses, only allowed redirects."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _TrackedHandler(watchdog, networks), redirects)
