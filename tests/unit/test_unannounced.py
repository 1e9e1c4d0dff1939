"""What requests and replies wait for while broadcast weights are taken (actor.engines.sglang.unannounced): nothing when
no broadcast is in question; a broadcast waits for the requests already on their way, and new ones for its decision; a
reply that reports weights being taken waits for the decision; refused when any weights it reports were dropped
(before the request was sent, or since) or no decision came in time."""

from __future__ import annotations

import threading
import time

import pytest

from actor.engines.sglang.unannounced import Unannounced, UnannouncedWeights, reply_names
from common.rollout import Sample


def later(what) -> tuple[threading.Thread, threading.Event]:  # type: ignore[no-untyped-def]
    """``what()`` in a thread; the event is set once it returned."""
    done = threading.Event()

    def run() -> None:
        what()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_a_reply_of_weights_not_in_question_stands_at_once() -> None:
    u = Unannounced(wait_s=30)
    assert u.receiving("5", timeout_s=1)
    t0 = time.monotonic()
    u.check({"4"})
    u.check(set())  # a server that reports no version
    assert time.monotonic() - t0 < 5


def test_a_broadcast_waits_for_the_requests_on_their_way_and_new_ones_for_its_decision() -> None:
    u = Unannounced(wait_s=30)
    with u.request():
        # Taken now, the weights would reach the server while this request may still be on its way to it.
        receiver, received = later(lambda: u.receiving("5", timeout_s=30))
        assert not received.wait(0.3)
    receiver.join(10)
    assert received.is_set()

    def send() -> None:
        with u.request():
            pass

    sender, sent = later(send)
    assert not sent.wait(0.3)  # sent now, it would be served by part of v5
    u.announced()
    sender.join(10)
    assert sent.is_set()


def test_a_broadcast_whose_requests_are_not_answered_in_time_takes_nothing() -> None:
    u = Unannounced(wait_s=30)
    with u.request():
        assert not u.receiving("5", timeout_s=0.2)
    with u.request():  # nothing is being taken: requests go as before
        pass


def test_a_reply_waits_for_the_announcement_and_then_stands() -> None:
    u = Unannounced(wait_s=30)
    assert u.receiving("5", timeout_s=1)
    checker, done = later(lambda: u.check({"5"}))
    assert not done.wait(0.3)  # undecided: it waits
    u.announced()
    checker.join(10)
    assert done.is_set()


def test_a_reply_of_dropped_weights_is_refused_until_announced_ones_replace_them() -> None:
    u = Unannounced(wait_s=30)
    assert u.receiving("5", timeout_s=1)
    errors: list[BaseException] = []

    def check() -> None:
        try:
            u.check({"5"})
        except UnannouncedWeights as e:
            errors.append(e)

    checker, _ = later(check)
    time.sleep(0.2)
    u.dropped()
    checker.join(10)
    assert len(errors) == 1 and "never announced" in str(errors[0])
    with u.request() as sent_while_dropped:
        pass
    with pytest.raises(UnannouncedWeights):
        u.check({"5"})
    u.announced()  # the successor's v5, loaded from disk
    u.check({"5"})
    # A request sent while the dropped weights were held is refused even when its reply comes after the load.
    with pytest.raises(UnannouncedWeights):
        u.check({"5"}, sent_while_dropped)


def test_a_reply_is_refused_when_any_of_its_tokens_came_from_dropped_weights() -> None:
    """In-flight updates: a turn that began on dropped v6 and ended on the successor's v8, loaded meanwhile."""
    u = Unannounced(wait_s=30)
    assert u.receiving("6", timeout_s=1)
    u.dropped()
    turn = [[Sample([1, 2, 3], [0.0] * 3, "stop", ((6, 2), (8, 1)))]]
    assert reply_names("8", turn) == {"6", "8"}
    with pytest.raises(UnannouncedWeights, match=r"\['6'\]"):
        u.check(reply_names("8", turn))


def test_weights_that_arrived_in_part_are_refused_under_either_name() -> None:
    """A broadcast of v6 that failed after its first bucket: the server reports v5 still, over a mix of both."""
    u = Unannounced(wait_s=30)
    assert u.receiving("6", timeout_s=1)
    u.dropped("5")
    for name in ("5", "6"):
        with pytest.raises(UnannouncedWeights):
            u.check({name})
    u.announced()
    u.check({"5"})


def test_no_decision_within_the_bound_is_a_refusal() -> None:
    u = Unannounced(wait_s=0.2)
    assert u.receiving("5", timeout_s=1)
    with pytest.raises(UnannouncedWeights, match="not announced within"):
        u.check({"5"})
    with pytest.raises(UnannouncedWeights, match="being taken"), u.request():
        pass
