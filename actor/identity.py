"""An actor's presence in Redis: its id, taken for one process at a time (two live processes under one ``actor.id``
would give back each other's claims on prompt positions at every round, and neither would send), and its heartbeat."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from common.liveness import Liveness
from common.transport import ActorTransport

log = logging.getLogger("actor")


def take_actor_id(transport: ActorTransport, actor_id: str, stop: threading.Event, liveness: Liveness) -> bool:
    """Take ``actor_id`` for this process once no live process beats under it: a restarted actor waits for its
    earlier self's heartbeat to lapse (at most ``run.heartbeat_ttl_s``), one configured with another's id for as long
    as that one lives, saying so. An earlier process under the id that was frozen meanwhile stops at its next draw
    (common.transport.Superseded). False when asked to stop while waiting."""
    said = False
    while (left := transport.heartbeat_left_s(actor_id)) is not None:
        if not said:
            said = True
            log.warning("actor.id %s is taken: a process beats under it (its heartbeat lapses in %.0fs unless it beats "
                        "again); waiting until it stops. Give each actor its own id", actor_id, left)  # fmt: skip
        liveness.beat(f"waiting for actor.id {actor_id} to be free", starting=True)
        if stop.wait(min(1.0, max(left, 0.05))):
            return False
    if (generation := transport.take_name(actor_id)) > 1:
        log.info("actor %s: this id was taken %d times before", actor_id, generation - 1)
    return True


class Heartbeat:
    """``actors:<id>`` refreshed with ``info()`` (version, groups sent, rounds), the reservations and claims of
    ``holders()`` renewed (a round longer than the lease keeps its room) and ``also()`` done (the NCCL registration),
    when a third of ``ttl_s`` has passed since the last beat. Called from the loop, and from a thread of its own while
    the loop is busy (:meth:`start`): a round may take longer than the TTL, and an actor whose key expires leaves the
    NCCL update group (and ``grpo status``) while it works. Redis clients are thread-safe."""

    def __init__(self, transport: ActorTransport, actor_id: str, ttl_s: float, info: Callable[[], dict[str, Any]],
                 holders: Callable[[], list[str]], also: Callable[[], None]):  # fmt: skip
        self.transport, self.id, self.ttl_s = transport, actor_id, ttl_s
        self.info, self.holders, self.also = info, holders, also
        self._next = 0.0
        self._lock = threading.Lock()  # the thread and the loop beat alike
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                return
            self._next = now + self.ttl_s / 3
            self.transport.heartbeat(self.id, self.ttl_s, self.info())
            for holder in self.holders():
                self.transport.renew_reservation(holder, self.ttl_s)
            self.also()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._forever, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _forever(self) -> None:
        """A failed beat is logged and tried again; the loop meets the same Redis and decides whether to give up."""
        every = self.ttl_s / 6  # well within the third of the TTL a beat is due after
        while not self._stop.wait(every):
            try:
                self()
            except Exception as e:
                log.warning("heartbeat failed: %s", e)
