"""Room for a round is reserved before it is sampled, on a real Redis: only as many groups ahead of the learner as it
can train before they pass max_staleness (rounds other actors are sampling included), and within the stream's bound."""

from __future__ import annotations

import time

import pytest

from common.config import RedisConfig
from common.transport import Admission, Transport

pytestmark = pytest.mark.integration

# Batches of 4 groups, a group may be trained up to 2 versions after it was sampled: 12 groups ahead at most.
ADMISSION = Admission(bound=64, batch_groups=4, max_staleness=2)


def announce(t: Transport, version: int) -> None:
    t.client.hset(t.keys.weights_latest, "version", version)  # all the reservation reads of an announcement


def test_a_round_is_admitted_only_while_it_can_be_trained_in_time(redis_url: str) -> None:
    t = Transport(RedisConfig(url=redis_url), "adm")
    announce(t, 10)
    t.produce([b"g"] * 8)  # two steps' worth unread
    # Sampled with version 10 behind 8 groups, a round of 4 is trained by version 12: admitted.
    assert t.reserve_round("a", 4, 10, ADMISSION, 30)
    # Behind those 12 (8 unread, 4 being sampled), the next round would be trained by version 13: refused.
    assert not t.reserve_round("b", 4, 10, ADMISSION, 30)
    assert t.client.hkeys(t.keys.inflight) == [b"a"]
    # Written, a round ends its reservation, and it is now unread: still 12 ahead.
    t.produce([b"g"] * 4, holder="a")
    assert t.client.hlen(t.keys.inflight) == 0
    assert not t.reserve_round("b", 4, 10, ADMISSION, 30)
    # The learner trains a batch and announces version 11: 8 ahead again, room for one more round of 4.
    t.client.delete(t.keys.groups)
    t.produce([b"g"] * 8)
    announce(t, 11)
    assert t.reserve_round("b", 4, 11, ADMISSION, 30)
    # An actor still on version 10 is a version behind: only 8 groups may be ahead of its round, not 12.
    t.release_round("b")
    assert not t.reserve_round("c", 4, 10, ADMISSION, 30)
    assert t.reserve_round("c", 4, 11, ADMISSION, 30)


def test_reservations_end_with_their_lease_and_the_stream_bound_still_holds(redis_url: str) -> None:
    t = Transport(RedisConfig(url=redis_url), "adm")
    announce(t, 0)
    # An actor killed while sampling: its reservation ends with its lease (renewed by heartbeats while it lives).
    assert t.reserve_round("killed", 12, 0, ADMISSION, 3)
    assert not t.reserve_round("b", 4, 0, ADMISSION, 30)
    t.renew_reservation("killed", 1)  # its last heartbeat
    time.sleep(1.2)
    assert t.reserve_round("b", 4, 0, ADMISSION, 30)
    assert t.client.hkeys(t.keys.inflight) == [b"b"]
    # Renewing a reservation that ended creates none.
    t.renew_reservation("killed", 30)
    assert t.client.hkeys(t.keys.inflight) == [b"b"]
    # Whatever staleness allows, at most `bound` groups are ahead; an empty pipeline admits any round.
    tight = Admission(bound=6, batch_groups=4, max_staleness=2)
    assert not t.reserve_round("c", 4, 0, tight, 30)
    t.release_round("b")
    assert t.reserve_round("c", 20, 0, tight, 30)
    # No announcement yet (or one whose version is not a number): only the stream's bound applies.
    t.client.delete(t.keys.weights_latest, t.keys.inflight)
    assert t.reserve_round("d", 60, 0, ADMISSION, 30)
