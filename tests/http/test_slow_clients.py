"""Slow and idle clients are closed by the server, a cap bounds its open connections, and none of
it cuts a request in flight: raw sockets against a real HTTP API on loopback over the shared
agent, each test with short deadlines (`HttpOptions`) for the one it exercises and long ones
for the rest, so a close can only come from the deadline under test.

A close is the server's: the socket reads EOF or is reset. Reads wait at most `PATIENCE_S`,
far beyond every short deadline here, so a server that keeps the connection fails the test.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai

from node_agent.http_api import HttpApiServer, HttpOptions
from tests.agent.helpers import wait_until
from tests.http.conftest import Served, all_blocks_free

SHORT_S = 0.5  # the deadline under test
LONG_S = 600.0  # the deadlines a test does not exercise
PATIENCE_S = 60.0  # how long a read waits for the server to close


@contextmanager
def side_server(
    served: Served, header_s: float = LONG_S, body_s: float = LONG_S, idle_s: float = LONG_S, max_connections: int = 100
) -> Iterator[HttpApiServer]:
    """An HTTP API over the shared agent (no token) with these limits."""
    options = HttpOptions(
        listen="127.0.0.1:0",
        stop_grace_s=0,
        header_timeout_s=header_s,
        body_timeout_s=body_s,
        idle_timeout_s=idle_s,
        max_connections=max_connections,
    )
    with HttpApiServer(served.agent, options) as server:
        yield server


def connect(server: HttpApiServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (EOF or reset); a server that
    keeps it open past `PATIENCE_S` raises TimeoutError."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def trickle_until_closed(sock: socket.socket, byte: bytes, seconds: float = PATIENCE_S) -> bool:
    """Send `byte` every 50 ms (a client that never stalls); True once the server has closed."""
    for _ in range(int(seconds / 0.05)):
        try:
            sock.sendall(byte)
        except (BrokenPipeError, ConnectionResetError):
            return True
        time.sleep(0.05)
    return False


def keep_alive(server: HttpApiServer) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=PATIENCE_S)
    assert health(connection) == 200
    return connection


def health(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/health")
    response = connection.getresponse()
    response.read()
    return response.status


def test_a_client_that_stops_mid_header_is_closed_after_the_header_deadline(served):
    with side_server(served, header_s=SHORT_S) as server, connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert read_until_closed(sock) == b""


def test_headers_trickled_without_a_pause_are_closed_at_the_header_deadline(served):
    """The deadline bounds the whole header, not the gaps between its bytes."""
    with side_server(served, header_s=SHORT_S) as server, connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        assert trickle_until_closed(sock, b"a"), "the server kept a trickled header open"


def test_a_keep_alive_client_is_held_to_the_header_deadline_per_request_not_per_connection(served):
    """Requests on one connection, their pauses alone spanning five header deadlines, all answer."""
    with side_server(served, header_s=SHORT_S) as server:
        connection = keep_alive(server)
        for _ in range(10):
            time.sleep(SHORT_S / 2)
            assert health(connection) == 200
        connection.close()


def test_a_body_that_stops_or_trickles_is_closed_after_the_body_deadline(served):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    with side_server(served, body_s=SHORT_S) as server:
        with connect(server) as sock:
            sock.sendall(head + b'{"model": "ad-a", ')
            assert read_until_closed(sock) == b""
        with connect(server) as sock:
            sock.sendall(head + b'{"model": "ad-a", "prompt": "')
            assert trickle_until_closed(sock, b"w"), "the server kept a trickled body open"
        connection = keep_alive(server)  # the server still answers
        connection.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(served):
    with side_server(served, idle_s=SHORT_S) as server:
        connection = keep_alive(server)
        assert connection.sock is not None
        assert read_until_closed(connection.sock) == b""
        connection.close()
        with connect(server) as sock:  # a connection that never sends a request is idle too
            assert read_until_closed(sock) == b""


def test_beyond_the_connection_cap_new_connections_are_refused_and_open_ones_still_answer(served):
    with side_server(served, max_connections=3) as server:
        held = [keep_alive(server) for _ in range(3)]
        with connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            refused = read_until_closed(sock)
        assert not refused or refused.startswith(b"HTTP/1.1 503 "), refused[:200]
        if refused:
            assert "--http-max-connections" in json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert [health(connection) for connection in held] == [200] * 3, "open connections still answer"
        held.pop().close()
        wait_until(lambda: _answers(server), what="a new connection once one closed")
        for connection in held:
            connection.close()


def _answers(server: HttpApiServer) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=PATIENCE_S)
    try:
        return health(connection) == 200
    except (ConnectionError, http.client.RemoteDisconnected):
        return False
    finally:
        connection.close()


def test_a_long_streamed_generation_outlives_every_deadline(served):
    """The deadlines bound reading a request; a response being streamed is a request in flight,
    whatever the pause between its events."""
    with side_server(served, header_s=SHORT_S / 5, body_s=SHORT_S / 5, idle_s=SHORT_S / 5) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-", max_retries=0, timeout=PATIENCE_S)
        stream = client.completions.create(model="ad-a", prompt="w1 w2", max_tokens=1000, stream=True)
        chunks = iter(stream)
        texts = [next(chunks).choices[0].text]
        # Every deadline passes five times over; short enough that a fast machine is still
        # generating the 1,000 tokens afterwards (the check below says so if not).
        time.sleep(SHORT_S)
        assert served.agent.engine.serving_stats().running == 1, (
            "not generating after the pause: cut by a deadline (or over before any passed)"
        )
        for chunk in chunks:
            texts += [choice.text for choice in chunk.choices]
        assert len(texts) == 1000 and chunk.choices[0].finish_reason == "length"
    wait_until(lambda: all_blocks_free(served), what="every block free")
