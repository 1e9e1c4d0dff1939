"""The run's identity in Redis, and what the learner does when Redis has lost the run.

A learner names its run with a random id kept both in Redis and in every checkpoint. At start the two must agree: a
learner pointed at another run's Redis (two runs under one ``run.name``) changes nothing there and stops with a
configuration error. Redis holding no id at all means it lost the run's state (restarted without persistence,
flushed, or failed over to an empty replica): the learner records the loss, recreates the stream, announces its
current version again, and trains on.
"""

from __future__ import annotations

import logging
import secrets

import redis

from common.config import Config, ConfigError
from common.transport import LearnerTransport
from learner.progress import Progress
from learner.publishing import Publisher

log = logging.getLogger("learner")


class RunClaim:
    """The learner's claim on its run in Redis (the run's identity there: common.schemas.RunIdentity)."""

    def __init__(self, cfg: Config, transport: LearnerTransport, publisher: Publisher):
        self.cfg = cfg
        self.transport = transport
        self.publisher = publisher

    def claim(self, p: Progress) -> None:
        """At start: the run id in Redis must be the checkpoint's. A fresh learner adopts the one in Redis (an
        earlier learner of this run died before its first checkpoint) or names the run; a checkpoint of an earlier
        build, which has none, names it too."""
        found = self.transport.identity_id()
        if not p.run_id:
            p.run_id = found or secrets.token_hex(8)
            self.transport.create_identity(p.run_id)
            return
        self.check(found, p)

    def check(self, found: str | None, p: Progress) -> None:
        """``found``: the run id Redis holds now. Another run's id is a configuration mistake (two runs under one
        ``run.name``); none at all means Redis lost this run's state, and the run goes on (see redis_lost)."""
        run_id = p.run_id
        if found == run_id:
            return
        if found is not None:
            raise ConfigError(
                f"config error: Redis holds run {found} under run.name {self.cfg.run.name}, but this learner's "
                f"checkpoints ({self.cfg.checkpoint.dir}) are run {run_id}'s: give each run its own run.name"
            )
        self.redis_lost(p)

    def redis_lost(self, p: Progress) -> None:
        """Redis restarted without persistence, was flushed or failed over to an empty replica: the stream, the
        counters and the announcement are gone. Name the run again (recording what was lost), recreate the stream,
        announce the current version again, and train on."""
        log.warning("Redis lost this run's state (restarted without persistence, flushed, or an empty replica): "
                    "%d groups trained until step %d are no longer in its counters (recorded in %s); the groups in "
                    "its stream are gone; training goes on", p.groups_consumed, p.step,
                    self.transport.keys.identity)  # fmt: skip
        self.transport.record_reset(p.run_id, p.step, p.groups_consumed)
        self.transport.ensure_consumer_group()
        p.window_ids, p.window_groups, p.window_positions = [], [], []  # their entries are gone: nothing to acknowledge
        self.publisher.announce_again()

    def stream_gone(self, e: redis.ResponseError, p: Progress) -> bool:
        """Whether a reply says the stream or its consumer group no longer exists (then: what happened to Redis?)."""
        text = str(e)
        if "NOGROUP" not in text and "no longer exists" not in text:
            return False
        self.check(self.transport.identity_id(), p)
        self.transport.ensure_consumer_group()  # the identity survived (the stream alone was deleted): recreate it
        return True
