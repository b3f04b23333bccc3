"""Self-checks of the fault-injection proxy (tests/support/faultproxy.py) against a real echo
server on loopback: each mode does what the end-to-end fault tests rely on."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.faultproxy import FaultProxy, Mode


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):  # the proxy resets on purpose
            while data := self.request.recv(65536):
                self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with FaultProxy(server.server_address[1]) as proxy:
            yield proxy
    finally:
        server.shutdown()
        server.server_close()


def connect(proxy: FaultProxy, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout_s)


def echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_pass_through_and_delay(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert echo(sock, b"hello") == b"hello"
        proxy.delay(0.3)
        started = time.monotonic()
        assert echo(sock, b"late") == b"late"
        assert time.monotonic() - started >= 0.3  # held at least once on the way
        proxy.pass_through()
        assert echo(sock, b"x" * 200_000) == b"x" * 200_000
    assert proxy.accepted == 1 and proxy.forwarded >= 2 * 200_000


def test_stall_holds_bytes_and_delivers_them_afterwards(proxy: FaultProxy) -> None:
    with connect(proxy, timeout_s=0.5) as sock:
        assert echo(sock, b"before") == b"before"
        proxy.stall()
        sock.sendall(b"held")
        with pytest.raises(TimeoutError):
            sock.recv(10)
        with connect(proxy, timeout_s=0.5) as new:  # a new connection is accepted and waits
            new.sendall(b"new")
            with pytest.raises(TimeoutError):
                new.recv(10)
            proxy.pass_through()
            new.settimeout(5)
            assert new.recv(10) == b"new"
        sock.settimeout(5)
        assert sock.recv(10) == b"held"  # nothing was lost


def test_blackhole_swallows_then_resets_what_lost_bytes(proxy: FaultProxy) -> None:
    with connect(proxy, timeout_s=0.5) as sock:
        assert echo(sock, b"before") == b"before"
        proxy.blackhole()
        sock.sendall(b"lost")
        with pytest.raises(TimeoutError):
            sock.recv(10)
        swallowed = connect(proxy, timeout_s=0.5)  # accepted, but never reaches the server
        swallowed.sendall(b"nobody")
        with pytest.raises(TimeoutError):
            swallowed.recv(10)
        proxy.pass_through()
        for broken in (sock, swallowed):
            broken.settimeout(5)
            with pytest.raises(ConnectionResetError):
                broken.recv(10)
        swallowed.close()
    with connect(proxy) as sock:  # healed: new connections work
        assert echo(sock, b"after") == b"after"


def test_reset_closes_open_and_new_connections_with_rst(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert echo(sock, b"before") == b"before"
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            sock.recv(10)
    # Reset at connect or at first use.
    with pytest.raises((ConnectionResetError, BrokenPipeError)), connect(proxy) as sock:
        sock.sendall(b"x")
        sock.recv(10)
        sock.sendall(b"x")
    proxy.pass_through()
    assert proxy.mode is Mode.PASS
    with connect(proxy) as sock:
        assert echo(sock, b"after") == b"after"


def test_retarget_sends_new_connections_elsewhere(proxy: FaultProxy) -> None:
    other = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Shout)
    other.daemon_threads = True
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with connect(proxy) as old:
            assert echo(old, b"first") == b"first"  # accepted and connected upstream
            proxy.retarget(other.server_address[1])
            assert echo(old, b"still") == b"still"  # open connections stay
            with connect(proxy) as new:
                assert echo(new, b"moved") == b"MOVED"
    finally:
        other.shutdown()
        other.server_close()


class _Shout(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):
            while data := self.request.recv(65536):
                self.request.sendall(data.upper())
