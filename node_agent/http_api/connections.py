"""The HTTP API's connections: deadlines for reading a request, and a cap on how many are open.

aiohttp bounds the sizes of a request line and its headers and closes a keep-alive connection
idle for `keepalive_timeout` (the server passes `idle_timeout_s`: it counts only while no
request is in flight), but it has no deadline for a request's headers or its body, and no cap
on open connections: a client that sends half a header line, or one body byte now and then,
holds a connection (a file descriptor and its buffers) for as long as it likes, and a
thousand of them hold a thousand.

So the listening socket's protocol is `GuardedConnection`, a thin `asyncio.Protocol` around
aiohttp's own (which parses HTTP; nothing here does). It refuses a connection beyond
`max_connections` at once (503, closed, never handed to aiohttp), and closes a connection
whose request headers have not all arrived `header_timeout_s` after their first byte, or whose
body has not all arrived `body_timeout_s` after its headers, without an answer (as nginx and
Go's servers do: the client is not sending its request). It learns where a request starts and
ends from the app: `ConnectionGuard.track`, the outermost middleware, marks a request in
flight from its headers to its answer, and `read_body` marks its body received. A response
being streamed is a request in flight: no deadline cuts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from node_agent.http_api.errors import ApiError

log = logging.getLogger(__name__)


class GuardedConnection(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, the deadline of what is being read outside."""

    def __init__(self, guard: ConnectionGuard, inner: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_inner = inner
        self._inner: asyncio.Protocol | None = None  # None: refused, or not yet made
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._in_flight = False  # a request's headers have arrived; its answer is not done

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if not self._guard.admit(transport, self):
            transport.write(self._guard.refusal())
            transport.close()
            return
        self._transport = transport
        self._inner = self._make_inner()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if not self._in_flight and self._deadline is None:  # the first byte of a request's headers
            self._arm(self._guard.header_timeout_s)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._inner is not None and self._transport is not None:
            self._guard.release(self._transport)
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def request_started(self, body_pending: bool) -> None:
        """A request's headers arrived: their deadline ends; its body's starts if it is still coming."""
        self._in_flight = True
        self._cancel()
        if body_pending:
            self._arm(self._guard.body_timeout_s)

    def body_received(self) -> None:
        self._cancel()

    def request_finished(self) -> None:
        self._in_flight = False
        self._cancel()

    def _arm(self, seconds: float) -> None:
        self._cancel()
        self._deadline = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._transport is not None:
            self._transport.abort()  # aiohttp's connection_lost cancels a handler still reading


_CONNECTION = web.RequestKey("connection", GuardedConnection)


class ConnectionGuard:
    """A server's open connections: the cap on their number, and the deadlines each is read under."""

    def __init__(self, header_timeout_s: float, body_timeout_s: float, max_connections: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_connections = max_connections
        self._open: dict[asyncio.BaseTransport, GuardedConnection] = {}
        self._refusing = False  # warned that the cap is reached (once until it is not)

    def protocols(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], GuardedConnection]:
        """The listening socket's protocol factory, around aiohttp's (`inner`)."""
        return lambda: GuardedConnection(self, inner)

    def admit(self, transport: asyncio.BaseTransport, connection: GuardedConnection) -> bool:
        """Whether a new connection may be served (False: the cap is reached)."""
        if len(self._open) >= self.max_connections:
            if not self._refusing:
                log.warning("the HTTP API holds %d connections (--http-max-connections): refusing new ones", len(self._open))
                self._refusing = True
            return False
        self._open[transport] = connection
        return True

    def release(self, transport: asyncio.BaseTransport) -> None:
        self._open.pop(transport, None)
        if len(self._open) < self.max_connections:
            self._refusing = False

    def refusal(self) -> bytes:
        """The whole answer to a connection beyond the cap: 503 in OpenAI's error shape, then close."""
        message = f"the server holds {self.max_connections} connections, its limit (--http-max-connections): retry later"
        body = json.dumps(ApiError(503, message, None, "too_many_connections").body()).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        return head.encode() + body

    @web.middleware
    async def track(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Mark the request in flight on its connection, from its headers to its answer."""
        connection = self._open.get(request.transport) if request.transport is not None else None
        if connection is None:  # the client already went away
            return await handler(request)
        connection.request_started(body_pending=request.can_read_body)
        request[_CONNECTION] = connection
        try:
            return await handler(request)
        finally:
            connection.request_finished()


async def read_body(request: web.Request) -> bytes:
    """The request's whole body, read under its deadline (armed when its headers arrived)."""
    body = await request.read()
    connection = request.get(_CONNECTION)
    if connection is not None:
        connection.body_received()
    return body
