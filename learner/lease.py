"""One learner per run: the learner takes the run's lease before it writes anything of the run, keeps it from a
thread, and stops at once when it finds another learner took the run over.

``take``: the lease (common.transport.lease), with ``learner.if_held`` deciding what a learner does while another
live one holds it (``wait``, saying for whom, at most ``learner.held_wait_s``; or ``exit``): :class:`LeaseHeld`, exit
code 4. Once held, the holder's marker (learner.fencing) is left before anything else. ``keep``: a thread renews it
every third of ``run.lease_ttl_s``, so a step or a checkpoint longer than the lease does not lose it; when Redis says
another learner holds the run, the thread says so in one line and interrupts the training loop, which stops with
:class:`LeaseLost` (exit code 5) wherever it is. ``release``: a learner that stops cleanly (SIGTERM, the last step)
gives the lease up, so its successor need not wait it out.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

from common.config import Config
from common.schemas import LeaseHolder
from common.transport import LearnerTransport, LeaseHeld, LeaseLost, lease_line
from learner import fencing

log = logging.getLogger("learner")

_NOTICE_S = 30.0  # a waiting learner says for whom it waits this often


class RunLease:
    def __init__(self, cfg: Config, transport: LearnerTransport, stop: threading.Event):
        self.cfg = cfg
        self.transport = transport
        self.stop = stop  # SIGTERM while waiting: stop waiting
        host = socket.gethostname()
        self.me = LeaseHolder(0, f"learner-{host}-{os.getpid()}-{secrets.token_hex(4)}", host, os.getpid(), 0.0)
        self.lost: LeaseLost | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    # -- taking it ----------------------------------------------------------------------------------------------

    def take(self) -> bool:
        """Hold the run, waiting for another holder as ``learner.if_held`` says; False: asked to stop while
        waiting. :class:`LeaseHeld` when it may not wait (longer)."""
        ttl, lc = self.cfg.run.lease_ttl_s, self.cfg.learner
        floor = fencing.floor(self.cfg.checkpoint.dir)
        t0 = time.monotonic()
        notice = 0.0
        while (held := self.transport.acquire_lease(self.me, ttl, floor)) is not None:
            waited = time.monotonic() - t0
            if lc.if_held == "exit" or waited >= lc.held_wait_s:
                raise LeaseHeld(f"run {self.cfg.run.name} is {lease_line(held)}"
                                + (f"; waited {waited:.0f}s (learner.held_wait_s)" if lc.if_held == "wait" else "")
                                + "; one learner trains a run")  # fmt: skip
            if waited >= notice:
                log.info("waiting for run %s: %s (waited %.0fs of learner.held_wait_s "
                         "%.0fs)", self.cfg.run.name, lease_line(held), waited, lc.held_wait_s)  # fmt: skip
                notice = waited + _NOTICE_S
            # Poll a few times per TTL: a holder that stops cleanly releases it at once, a dead one after its TTL.
            if self.stop.wait(min(max(0.2, ttl / 6), lc.held_wait_s - waited)):
                return False
        assert self.transport.holder is not None
        self.transport.lease_floor = lambda: fencing.floor(self.cfg.checkpoint.dir)
        log.info("holding run %s with lease token %d (run.lease_ttl_s %.0fs)", self.cfg.run.name,
                 self.transport.holder.token, ttl)  # fmt: skip
        return True

    def mark(self, base_step: int, base_version: int) -> Path:
        """Leave this holder's marker (learner.fencing): what it found, before it writes anything else."""
        token = self.transport.lease_token()
        return fencing.write_marker(self.cfg.checkpoint.dir, fencing.Marker(token, base_step, base_version,
                                                                     self.me.host, self.me.pid))  # fmt: skip

    # -- keeping it ---------------------------------------------------------------------------------------------

    def keep(self) -> None:
        """Renew from a thread; on loss, interrupt the main thread, which raises :class:`LeaseLost` where it is."""
        signal.signal(signal.SIGUSR1, self._raise_lost)
        self._thread = threading.Thread(target=self._renew, name="grpo-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        every = self.cfg.run.lease_ttl_s / 3
        while not self._done.wait(every):
            try:
                self.transport.renew_lease()
            except LeaseLost as e:
                log.error("stopping at once: %s", e)
                self.lost = e
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
                return
            except Exception as e:  # Redis away: its own retries say so; the lease is kept if it comes back in time
                log.warning("could not renew the learner's lease: %s", e)

    def _raise_lost(self, *_: object) -> None:
        if self.lost is not None:
            raise self.lost

    def release(self) -> None:
        """Stop renewing; give the run up if this learner still holds it (a clean stop)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost is None and self.transport.lease_token():
            try:
                self.transport.release_lease()
            except Exception as e:  # the successor then waits out the TTL
                log.warning("could not give the learner's lease up: %s", e)
