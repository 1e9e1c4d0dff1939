"""A TCP proxy on loopback between one process and Redis that can hold one command: every byte is forwarded both
ways, until a client sends a chunk that ``hold`` (a predicate of the test's) accepts; that chunk and everything after
it on its connection wait, as if the network had stopped on that one connection, until :meth:`HoldingProxy.release`
forwards them or :meth:`HoldingProxy.cut` closes the connection. Only the first chunk accepted is held (the
predicate is asked again only after a release). Traffic to loopback alone; every socket and thread ends with
:meth:`HoldingProxy.close`."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlparse

Hold = Callable[[bytes], bool]


class HoldingProxy:
    def __init__(self, redis_url: str, hold: Hold):
        target = urlparse(redis_url)
        self.target = (target.hostname or "127.0.0.1", target.port or 6379)
        self.hold = hold
        self.held = threading.Event()  # a chunk is being held
        self.chunk = b""  # the chunk held
        self._go = threading.Event()  # release: forward it and go on
        self._cut = False
        self._armed = True
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def release(self) -> None:
        """Forward the chunk held (and what followed it) and go on; the predicate is asked again from now on."""
        self._go.set()

    def cut(self) -> None:
        """Close the held connection: its client sees the connection lost (and reconnects, through the proxy)."""
        self._cut = True
        self._go.set()

    def close(self) -> None:
        self._closed = True
        self._go.set()
        with self._lock:
            for s in [self._listener, *self._sockets]:
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, upstream]
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(client, upstream, pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, pair, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, ...], asks: bool) -> None:
        try:
            while data := src.recv(65536):
                if asks and self._armed and self.hold(data):
                    self._hold(data, pair)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.close()

    def _hold(self, data: bytes, pair: tuple[socket.socket, ...]) -> None:
        self._armed = False
        self.chunk = data
        self._go.clear()
        self.held.set()
        self._go.wait()
        self.held.clear()
        if self._cut or self._closed:
            self._cut = False
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            raise OSError("cut")
        self._armed = True
