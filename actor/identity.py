"""An actor's id, taken for one process at a time: two live processes under one ``actor.id`` would give back each
other's claims on prompt positions at every round, and neither would send."""

from __future__ import annotations

import logging
import threading

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
