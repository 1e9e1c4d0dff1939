"""One HTTP ``POST`` held to a deadline, from looking the host's name up to the answer's last byte, for the scoring
service's attempts (:mod:`grader.service`), with the standard library alone.

The standard library bounds each wait on a socket, not a request: a server that sends a byte of its status line,
its headers or its body before each read would time out keeps ``http.client`` reading as long as it likes, and
``socket.getaddrinfo`` takes no time-out at all. Here a watchdog shuts the connection down at the deadline, whatever
the request is waiting for then (what the cut connection returned or raised is then a TimeoutError, not an answer),
every socket wait ends by the deadline too, and the name is looked up in a thread waited on for the time left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.client
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

MAX_ANSWER_BYTES = 16 << 20  # a batch's scores take bytes; a larger answer is not one (service_invalid)


def post(url: str, body: bytes, deadline: float, resolver: Resolver) -> tuple[int, bytes]:
    """One ``POST`` of JSON: ``(status, answer)`` by ``deadline`` (a ``time.monotonic()`` time), or TimeoutError,
    OSError or http.client.HTTPException. The name is resolved and the connection made within the time, every wait
    on the socket ends by the deadline, and the watchdog cuts the connection there whatever it is waiting for."""
    parts = urlsplit(url)
    watchdog = _Watchdog(deadline)
    conn = (_TLSConnection if parts.scheme.lower() == "https" else _Connection)(parts.hostname or "", parts.port)
    conn.opener = functools.partial(open_socket, deadline=deadline, watchdog=watchdog, resolver=resolver)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        return _exchange(conn, path, body)
    finally:
        cut = watchdog.stop()  # before the close: from here on the watchdog cuts nothing
        conn.close()
        if cut:  # what the cut connection returned or raised (a short answer, a reset) is not the scorer's answer
            raise TimeoutError("cut at the attempt's deadline")


def _exchange(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "Accept": "application/json", "Connection": "close"}
    conn.request("POST", path, body, headers)
    response = conn.getresponse()
    answer = bytearray()
    while chunk := response.read1(1 << 16):
        answer += chunk
        if len(answer) > MAX_ANSWER_BYTES:
            raise http.client.HTTPException(f"an answer of more than {MAX_ANSWER_BYTES} bytes")
    return response.status, bytes(answer)


def open_socket(host: str, port: int, *, deadline: float, watchdog: _Watchdog, resolver: Resolver) -> socket.socket:
    """A TCP connection to ``host``, tried at each address its name resolves to in turn (as
    ``socket.create_connection`` does) but within ``deadline`` in all, the socket watched by ``watchdog``, each of
    its later waits ending by the deadline too."""
    error: OSError = OSError(f"{host!r} resolves to no address")
    for family, kind, proto, _, address in resolver.resolve(host, port, deadline):
        sock = socket.socket(family, kind, proto)
        try:
            watchdog.watch(sock)
            sock.settimeout(_time_left(deadline))
            sock.connect(address)
            watchdog.check()  # the deadline passed while connecting: shutting down did nothing then
            sock.settimeout(_time_left(deadline))
            return sock
        except OSError as e:
            sock.close()
            if isinstance(e, TimeoutError):  # the attempt's time is gone: no time for the next address either
                raise
            error = e
    raise error


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the attempt's deadline passed")
    return left


class _Connection(http.client.HTTPConnection):
    """An HTTP connection whose socket comes from ``opener`` (set before the request: :func:`open_socket` bound to
    the attempt), not from ``socket.create_connection``, whose name lookup has no time-out."""

    opener: Callable[[str, int], socket.socket]

    def connect(self) -> None:
        self.sock = self.opener(self.host, self.port)
        with contextlib.suppress(OSError):  # as http.client does: the request goes out at once
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _TLSConnection(http.client.HTTPSConnection, _Connection):
    """HTTPS: HTTPSConnection.connect takes its socket from the next class's connect (``_Connection``'s) and wraps
    it in TLS; the handshake waits on that socket, its time-out the time left, under the same watchdog."""


class _Watchdog:
    """Shuts an attempt's connection down at its deadline, whatever the attempt is waiting for then: the one bound
    that holds over a whole attempt. Shutting a socket down wakes what reads or writes it (TLS included), which
    then fails or sees the answer end. It holds a duplicate of the connection's descriptor, its own to close: it
    never shuts down a descriptor that was closed and reused for something else."""

    def __init__(self, deadline: float):
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._over = False
        self.fired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        """Cut ``sock`` (created, not yet connected) at the deadline; TimeoutError when it has passed."""
        with self._lock:
            self._check()
            self._drop()
            self._sock = sock.dup()

    def check(self) -> None:
        with self._lock:
            self._check()

    def _check(self) -> None:
        if self.fired:
            raise TimeoutError("the attempt's deadline passed")

    def stop(self) -> bool:
        """Watch no more (call before the connection is closed); whether it cut the connection."""
        self._timer.cancel()
        with self._lock:
            self._over = True
            self._drop()
            return self.fired

    def _fire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.fired = True
            if self._sock is not None:
                with contextlib.suppress(OSError):  # not connected yet: connect ends by the deadline on its own
                    self._sock.shutdown(socket.SHUT_RDWR)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]


class Resolver:
    """``getaddrinfo`` within a time: the standard library's takes no time-out (a resolver that does not answer
    holds the caller as long as the system's retries last, tens of seconds), so the lookup runs in a thread that the
    caller waits on for the time it has. A lookup still running when its caller gave up is not started again: the
    next caller for the same host and port waits on it, so a hung resolver holds one thread per host, not one per
    attempt. Nothing is cached: each attempt resolves afresh (a scorer's address may change)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], concurrent.futures.Future[Sequence[AddrInfo]]] = {}

    def resolve(self, host: str, port: int, deadline: float) -> Sequence[AddrInfo]:
        """The addresses of ``host``, by ``deadline``, or TimeoutError; a failed lookup raises its socket.gaierror
        (an OSError)."""
        key = (host, port)
        with self._lock:
            lookup = self._pending.get(key)
            if lookup is None:
                lookup = self._pending[key] = concurrent.futures.Future()
                threading.Thread(target=self._look_up, args=(key, lookup), name=f"resolve {host}", daemon=True).start()
        try:
            return lookup.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise TimeoutError(f"no address for {host!r} in time") from None

    def _look_up(self, key: tuple[str, int], lookup: concurrent.futures.Future[Sequence[AddrInfo]]) -> None:
        try:
            lookup.set_result(socket.getaddrinfo(key[0], key[1], 0, socket.SOCK_STREAM))
        except Exception as e:  # a failed lookup is the callers' to count; a bug is theirs to raise
            lookup.set_exception(e)
        finally:
            with self._lock:
                del self._pending[key]
