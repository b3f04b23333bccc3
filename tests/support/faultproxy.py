"""A fault-injection TCP proxy for tests: sits between a client and a server on 127.0.0.1 and
delays, stalls, resets or black-holes their connections, switched at run time by the test.

    with FaultProxy(upstream_port) as proxy:     # listens on 127.0.0.1:proxy.port
        client.connect(("127.0.0.1", proxy.port))
        proxy.stall()        # stop forwarding; bytes wait (the peers see a hung other side)
        proxy.pass_through() # forward again: what waited is delivered, nothing is lost

Modes (one at a time, for every connection, current and new):

* ``pass_through()`` — forward both ways (the initial mode);
* ``delay(seconds)`` — forward each chunk ``seconds`` after it was read (order kept);
* ``stall()`` — stop reading from either side: bytes wait in the kernel's buffers, the
  senders block once those are full; new connections are accepted and wait too. Leaving the
  mode delivers everything: a paused peer, not a lossy network;
* ``blackhole()`` — a partition: everything read from either side is thrown away, nothing is
  delivered, new connections are accepted and swallowed (never connected upstream). The peers
  see silence until their own timeouts. Leaving the mode resets every connection that lost
  bytes (their streams are broken), as a long partition ends for TCP;
* ``reset()`` — every open connection is closed with a TCP RST on both sides, and new ones are
  reset as soon as they are accepted, until another mode is chosen.

``retarget(port)`` sends new connections to another upstream (open ones stay where they are;
``reset()`` first to move everything), e.g. to a server that answers errors for a while.

Plain threads and sockets, no dependencies; ``accepted`` and ``forwarded`` count connections and
bytes so a test can see that traffic really went through the proxy.
"""

from __future__ import annotations

import contextlib
import enum
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

_POLL_S = 0.05
_CHUNK = 65536


class Mode(enum.Enum):
    PASS = "pass"
    DELAY = "delay"
    STALL = "stall"
    BLACKHOLE = "blackhole"
    RESET = "reset"


def _rst_close(sock: socket.socket | None) -> None:
    """Close with an RST instead of a FIN (SO_LINGER 0)."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


@dataclass(eq=False)
class _Connection:
    client: socket.socket
    upstream: socket.socket | None
    lost: bool = False  # bytes were thrown away (black hole): the stream is broken
    closed: bool = False
    threads: list[threading.Thread] = field(default_factory=list)

    def close(self, *, rst: bool) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            if rst:
                _rst_close(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.close()


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` (0: a free one) to ``upstream_host:upstream_port``."""

    def __init__(self, upstream_port: int, *, upstream_host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Condition()
        self._mode = Mode.PASS
        self._delay_s = 0.0
        self._connections: list[_Connection] = []
        self._stopped = threading.Event()
        self._acceptor: threading.Thread | None = None
        self.accepted = 0
        self.forwarded = 0

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"faultproxy-{self.port}", daemon=True)
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Stop accepting and close every connection."""
        self._stopped.set()
        with self._lock:
            self._lock.notify_all()
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close(rst=False)
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._acceptor is not None:
            self._acceptor.join(5)
        for conn in connections:
            for thread in conn.threads:
                thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ---- switching modes ------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    def pass_through(self) -> None:
        self._set(Mode.PASS)

    def delay(self, seconds: float) -> None:
        self._set(Mode.DELAY, seconds)

    def stall(self) -> None:
        self._set(Mode.STALL)

    def blackhole(self) -> None:
        self._set(Mode.BLACKHOLE)

    def reset(self) -> None:
        self._set(Mode.RESET)

    def _set(self, mode: Mode, delay_s: float = 0.0) -> None:
        with self._lock:
            leaving_blackhole = self._mode is Mode.BLACKHOLE and mode is not Mode.BLACKHOLE
            self._mode, self._delay_s = mode, delay_s
            doomed = [c for c in self._connections if mode is Mode.RESET or (leaving_blackhole and c.lost)]
            self._connections = [c for c in self._connections if c not in doomed]
            self._lock.notify_all()
        for conn in doomed:
            conn.close(rst=True)

    def retarget(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        """New connections go to ``upstream_host:upstream_port`` from now on."""
        with self._lock:
            self.upstream = (upstream_host, upstream_port)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    # ---- forwarding ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        self._listener.settimeout(_POLL_S * 4)
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            mode = self._mode
            if mode is Mode.RESET:
                _rst_close(client)
                continue
            upstream = None
            if mode is not Mode.BLACKHOLE:
                try:
                    upstream = socket.create_connection(self.upstream, timeout=5)
                except OSError:
                    _rst_close(client)  # nothing listens upstream: the client sees a reset
                    continue
            conn = _Connection(client, upstream, lost=upstream is None)
            with self._lock:
                if self._stopped.is_set():
                    conn.close(rst=False)
                    return
                self._connections.append(conn)
            pairs = [(client, upstream)] + ([(upstream, client)] if upstream else [])
            for src, dst in pairs:
                thread = threading.Thread(target=self._pump, args=(conn, src, dst), daemon=True, name=f"faultproxy-{self.port}-pump")
                conn.threads.append(thread)
                thread.start()

    def _wait_while_stalled(self, conn: _Connection) -> bool:
        """Block while the mode is STALL; False when the connection or the proxy is done."""
        with self._lock:
            while self._mode is Mode.STALL and not conn.closed and not self._stopped.is_set():
                self._lock.wait(_POLL_S * 4)
        return not conn.closed and not self._stopped.is_set()

    def _pump(self, conn: _Connection, src: socket.socket, dst: socket.socket | None) -> None:
        try:
            while self._wait_while_stalled(conn):
                readable, _, _ = select.select([src], [], [], _POLL_S * 4)
                if not readable:
                    continue
                data = src.recv(_CHUNK)
                if not data:
                    break
                if self._mode is Mode.BLACKHOLE or dst is None:
                    conn.lost = True
                    continue
                if self._mode is Mode.DELAY:
                    time.sleep(self._delay_s)
                if not self._wait_while_stalled(conn):  # stalled after reading: hold the chunk
                    break
                if self._mode is Mode.BLACKHOLE:
                    conn.lost = True
                    continue
                # Under the lock: both directions' pumps count at once, and `+=` alone can lose
                # an update. Before sending: once a peer has the bytes, they are counted.
                with self._lock:
                    self.forwarded += len(data)
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        conn.close(rst=False)
