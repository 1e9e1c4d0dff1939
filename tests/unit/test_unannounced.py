"""What a request and its reply wait for while broadcast weights are taken (actor.unannounced): nothing when no
broadcast is in question; while one is being taken or announced, the decision; refused when the weights were dropped
(before the request was sent, or since) or no decision came in time."""

from __future__ import annotations

import threading
import time

import pytest

from actor.unannounced import Unannounced, UnannouncedWeights


def test_a_reply_of_weights_not_in_question_stands_at_once() -> None:
    u = Unannounced(wait_s=30)
    u.receiving("5")
    t0 = time.monotonic()
    u.check("4")
    u.check(None)  # a server that reports no version
    assert time.monotonic() - t0 < 5


def test_a_reply_waits_for_the_announcement_and_then_stands() -> None:
    u = Unannounced(wait_s=30)
    u.receiving("5")
    done = threading.Event()

    def check() -> None:
        u.check("5")
        done.set()

    waiter = threading.Thread(target=check)
    waiter.start()
    assert not done.wait(0.3)  # undecided: it waits
    u.announced()
    waiter.join(10)
    assert done.is_set()


def test_a_reply_of_dropped_weights_is_refused_until_announced_ones_replace_them() -> None:
    u = Unannounced(wait_s=30)
    u.receiving("5")
    errors: list[BaseException] = []

    def check() -> None:
        try:
            u.check("5")
        except UnannouncedWeights as e:
            errors.append(e)

    waiter = threading.Thread(target=check)
    waiter.start()
    time.sleep(0.2)
    u.dropped()
    waiter.join(10)
    assert len(errors) == 1 and "never announced" in str(errors[0])
    sent_while_dropped = u.sending()
    with pytest.raises(UnannouncedWeights):
        u.check("5")
    u.announced()  # the successor's v5, loaded from disk
    u.check("5")
    # A request sent while the dropped weights were held is refused even when its reply comes after the load.
    with pytest.raises(UnannouncedWeights):
        u.check("5", sent_while_dropped)


def test_no_decision_within_the_bound_is_a_refusal() -> None:
    u = Unannounced(wait_s=0.2)
    u.receiving("5")
    with pytest.raises(UnannouncedWeights, match="not announced within"):
        u.check("5")


def test_a_request_waits_while_weights_are_taken_and_goes_once_they_are_announced() -> None:
    u = Unannounced(wait_s=30)
    u.receiving("5")
    sent = threading.Event()

    def send() -> None:
        u.sending()
        sent.set()

    waiter = threading.Thread(target=send)
    waiter.start()
    assert not sent.wait(0.3)  # sent now, it would be served by part of v5
    u.announced()
    waiter.join(10)
    assert sent.is_set()
    with pytest.raises(UnannouncedWeights, match="being taken"):
        short = Unannounced(wait_s=0.2)
        short.receiving("6")
        short.sending()


def test_weights_that_arrived_in_part_are_refused_under_either_name() -> None:
    """A broadcast of v6 that failed after its first bucket: the server reports v5 still, over a mix of both."""
    u = Unannounced(wait_s=30)
    u.receiving("6")
    u.dropped("5")
    for name in ("5", "6"):
        with pytest.raises(UnannouncedWeights):
            u.check(name)
    u.announced()
    u.check("5")
