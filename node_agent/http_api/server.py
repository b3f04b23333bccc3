"""The HTTP API's server: its settings, and the thread its event loop runs on.

aiohttp serves the routes (`routes`) on an event loop of its own thread, beside the gRPC
server's thread pool, over the same `Agent`; HTTPS with gRPC's certificate and key.

Slow clients: every connection is read under deadlines and their number is capped
(`connections`): a request's headers within `header_timeout_s` of its first byte, its body
within `body_timeout_s` of its headers, at most `idle_timeout_s` idle between requests (aiohttp's
keep-alive timeout), at most `max_connections` open.

Disconnects: the server cancels the handler of a client that goes away (aiohttp's
`handler_cancellation`), which closes its generations: the engine drops the sequences and frees
their KV blocks.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass

from aiohttp import web

from node_agent.agent import Agent
from node_agent.auth import TlsFiles
from node_agent.http_api.connections import ConnectionGuard
from node_agent.http_api.routes import ApiRoutes, Budget


@dataclass(frozen=True)
class HttpOptions:
    """How the HTTP API listens and who may call it."""

    listen: str = "127.0.0.1:0"  # HOST:PORT; port 0 picks a free one (see HttpApiServer.port)
    auth_token: str | None = None  # the same token as gRPC: `Authorization: Bearer <token>`
    tls: TlsFiles | None = None  # the same files as gRPC: HTTPS, client certificates with a client CA
    stop_grace_s: float = 10.0  # how long stop() lets running requests finish
    # Reading requests (docs/http-api.md, "Slow clients"); a response being sent is never cut.
    header_timeout_s: float = 10.0  # a request's headers, from their first byte (and a TLS handshake)
    body_timeout_s: float = 60.0  # a request's body, from its headers
    idle_timeout_s: float = 75.0  # a keep-alive connection with no request in flight
    max_connections: int = 512  # open at once; beyond, a new connection is answered 503 and closed

    def __post_init__(self) -> None:
        for flag, value in (
            ("--http-header-timeout-s", self.header_timeout_s),
            ("--http-body-timeout-s", self.body_timeout_s),
            ("--http-idle-timeout-s", self.idle_timeout_s),
            ("--http-max-connections", self.max_connections),
        ):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")


def split_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 hosts in brackets) as (host, port); ValueError naming the flag otherwise."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--http-listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


class HttpApiServer:
    """The OpenAI-compatible API over one agent, served on a thread of its own."""

    def __init__(self, agent: Agent, options: HttpOptions, budget: Budget | None = None, closing: threading.Event | None = None) -> None:
        """`budget`: the inference budget shared with gRPC (None: unlimited); `closing`: set
        when the agent stops taking inference (the gRPC servicer's flag)."""
        self.agent = agent
        self.options = options
        self.host, self._requested_port = split_listen(options.listen)
        self.port = 0
        self._api = ApiRoutes(agent, options.auth_token, budget, closing or threading.Event())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    def start(self) -> None:
        """Bind and serve; raises OSError when the address cannot be bound."""
        self._thread = threading.Thread(target=self._serve, name="lorafleet-http", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise OSError(f"cannot listen on {self.options.listen} (--http-listen): {self._failure}") from self._failure

    def stop(self) -> None:
        """Stop taking connections; running requests get `stop_grace_s`, then are cancelled."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._loop = self._thread = None

    def __enter__(self) -> HttpApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._open())
        except BaseException as error:
            self._failure = error
            self._ready.set()
            loop.close()
            return
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            if self._listener is not None:
                self._listener.close()
            if self._runner is not None:
                loop.run_until_complete(self._runner.cleanup())
            loop.close()

    async def _open(self) -> None:
        options = self.options
        tls = _ssl_context(options.tls) if options.tls is not None else None
        guard = ConnectionGuard(options.header_timeout_s, options.body_timeout_s, options.max_connections)
        # handler_cancellation: a client that disconnects cancels its handler (and generations).
        runner = web.AppRunner(
            self._api.app(guard.track),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=options.stop_grace_s,
            keepalive_timeout=options.idle_timeout_s,
        )
        await runner.setup()
        assert runner.server is not None  # set up
        try:
            # The listener aiohttp's TCPSite would open, with the guard's protocol around aiohttp's.
            listener = await asyncio.get_running_loop().create_server(
                guard.protocols(runner.server),
                self.host,
                self._requested_port,
                ssl=tls,
                ssl_handshake_timeout=options.header_timeout_s if tls is not None else None,
            )
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._listener = runner, listener
        self.port = int(listener.sockets[0].getsockname()[1])


def _ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """HTTPS with gRPC's certificate and key; with a client CA, client certificates are required."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca is not None:
        context.load_verify_locations(tls.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
