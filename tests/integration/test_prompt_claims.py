"""Every prompt position drawn is accounted for, on a real Redis: the scripts that draw positions under a claim, settle
the claim with the round's write, give back the positions of a claim whose actor is gone (or that an actor lets go),
and mark trained positions as the learner acknowledges their groups (common.transport.prompts, admission, delivery;
the forms and the equation: common.schemas.prompts)."""

from __future__ import annotations

import time

import pytest

from common.config import RedisConfig
from common.schemas import PromptClaim, SchemaError
from common.transport import Admission, ClaimLost, LeaseLost, Superseded, Transport, read_balance

pytestmark = pytest.mark.integration


def transport(url: str, run: str = "p") -> Transport:
    return Transport(RedisConfig(url=url, retries=1), run)


def settled(t: Transport, holder: str, sent: int, **fates: int) -> None:
    """Write ``holder``'s round: ``sent`` groups, the other positions' fates as ``kind_reason=n``."""
    counters = {"prompts_sent": sent, **{"prompts_" + k.replace("_", ":", 1): n for k, n in fates.items()}}
    t.produce([b"g"] * sent, counters, holder=holder, claim=True)


def test_a_round_draws_under_a_claim_and_its_write_settles_every_position(redis_url: str) -> None:
    t = transport(redis_url)
    t.ensure_consumer_group()
    assert t.next_prompts(4, "a", 5) == [0, 1, 2, 3]
    assert t.next_prompts(2, "a", 5, new_round=False) == [4, 5]  # more for the same round (difficulty sampling)
    assert t.next_prompts(3, "b", 5) == [6, 7, 8]
    pb = t.prompt_balance()
    assert pb.claims["a"].positions == (0, 1, 2, 3, 4, 5) and pb.claimed == 9 and pb.unexplained == 0, pb.equation()
    assert t.client.hget(t.keys.prompts_claims, "a").decode().endswith(" 0-3,4-5")  # PromptClaim's form: ranges
    # Of a's six: 3 sent, 1 filtered, 1 passed over, 1 too long; b's round is still being sampled.
    settled(t, "a", 3, filtered_zero_std=1, skipped_difficulty=1, skipped_too_long=1)
    pb = t.prompt_balance()
    assert "a" not in pb.claims and pb.claimed == 3 and pb.unexplained == 0, pb.equation()
    c = pb.counters
    assert (c.drawn, c.sent, c.filtered, c.skipped) == (9, 3, {"zero_std": 1}, {"difficulty": 1, "too_long": 1})
    assert read_balance(t).produced == 3  # the sent positions are the groups' equation's
    assert pb.equation().endswith("(balanced)"), pb.equation()


def test_a_dead_actors_positions_are_drawn_again_and_its_late_round_refused(redis_url: str) -> None:
    t = transport(redis_url)
    t.ensure_consumer_group()
    assert t.next_prompts(3, "dead", 0.2) == [0, 1, 2]
    time.sleep(0.3)  # its lease runs out: nobody renewed it
    # The next draw of anyone gives them back and takes them first, then new positions.
    assert t.next_prompts(5, "alive", 5) == [0, 1, 2, 3, 4]
    pb = t.prompt_balance()
    assert pb.counters.requeued == {"lost": 3} and pb.counters.redrawn == 3 and pb.unexplained == 0, pb.equation()
    # The frozen actor wakes and sends its round: refused whole, nothing written (its positions are alive's now).
    with pytest.raises(ClaimLost, match="dead"):
        settled(t, "dead", 3)
    assert t.stream_length() == 0 and t.prompt_balance().counters.sent == 0
    settled(t, "alive", 5)
    pb = t.prompt_balance()
    assert (pb.counters.drawn, pb.counters.sent, pb.claimed, pb.to_redraw, pb.unexplained) == (5, 5, 0, 0, 0)


def test_more_positions_for_a_round_whose_claim_is_gone_are_refused_and_nothing_drawn(redis_url: str) -> None:
    """Difficulty sampling draws more for the same round: an actor frozen past its lease between two draws must not
    start a new claim with the second, or its round would repeat the first draw's positions, which others now hold."""
    t = transport(redis_url)
    assert t.next_prompts(3, "frozen", 0.2) == [0, 1, 2]
    time.sleep(0.3)
    assert t.next_prompts(5, "alive", 5) == [0, 1, 2, 3, 4]  # gives back frozen's and takes them first
    with pytest.raises(ClaimLost, match="frozen"):
        t.next_prompts(2, "frozen", 5, new_round=False)
    pb = t.prompt_balance()
    assert "frozen" not in pb.claims and pb.counters.drawn == 5 and pb.unexplained == 0, pb.equation()
    assert t.next_prompts(1, "alive2", 5) == [5]  # the cursor did not move for the refused draw


def test_a_draw_or_a_write_sent_again_after_a_lost_reply_acts_once(redis_url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """redis-py sends a call again when its connection drops, and Redis may have run it already: the same call (the
    same token, as a resend carries) answers what it did the first time instead of doing it twice."""
    t = transport(redis_url)
    t.ensure_consumer_group()
    for module in ("common.transport.prompts", "common.transport.admission"):
        monkeypatch.setattr(f"{module}.call_token", lambda: "resent")
    monkeypatch.setattr("common.transport.connection.call_token", lambda: "feed")  # a resend's round is its own
    assert t.next_prompts(2, "a", 5) == [0, 1]
    assert t.next_prompts(2, "a", 5) == [0, 1]  # not given back as lost and drawn anew
    assert t.next_prompts(2, "a", 5, new_round=False) == [0, 1]  # not two more positions nobody knows of
    pb = t.prompt_balance()
    assert pb.claims["a"].positions == (0, 1) and pb.counters.drawn == 2 and not pb.counters.requeued
    settled(t, "a", 2)
    assert t.produce([b"g"] * 2, {"prompts_sent": 2}, holder="a", claim=True) == []  # done, not ClaimLost
    pb = t.prompt_balance()
    assert t.stream_length() == 2 and (pb.counters.sent, pb.claimed, pb.unexplained) == (2, 0, 0), pb.equation()
    monkeypatch.undo()  # a new call, with a token of its own: the next round
    assert t.next_prompts(1, "a", 5) == [2]
    with pytest.raises(ClaimLost):  # a write whose claim was settled by another call, not this one
        t.produce([b"g"], {"prompts_sent": 1}, holder="b", claim=True)


def test_a_renewed_claim_is_kept_and_a_released_one_given_back(redis_url: str) -> None:
    t = transport(redis_url)
    t.next_prompts(2, "slow", 0.3)
    for _ in range(3):  # a round longer than the lease: the heartbeat renews it
        time.sleep(0.15)
        t.renew_reservation("slow", 0.3)
    assert t.next_prompts(1, "other", 5) == [2]  # nothing was given back
    t.release_round("other")  # a round let go unsampled (the actor stops)
    pb = t.prompt_balance()
    assert pb.counters.requeued == {"released": 1} and pb.to_redraw == 1 and pb.unexplained == 0, pb.equation()
    assert t.next_prompts(2, "third", 5) == [2, 3]  # drawn again first


def test_a_holders_leftover_claim_is_an_earlier_processs_and_given_back(redis_url: str) -> None:
    """An actor restarted under the same id (a container's hostname and pid 1) finds its dead self's claim."""
    t = transport(redis_url)
    t.next_prompts(2, "actor-1", 60)
    assert t.next_prompts(3, "actor-1", 60) == [0, 1, 2]  # a new round: the old claim's positions first
    pb = t.prompt_balance()
    assert pb.claims["actor-1"].positions == (0, 1, 2) and pb.counters.requeued == {"lost": 2}
    assert pb.unexplained == 0, pb.equation()


def test_a_process_woken_under_a_name_a_newer_one_holds_neither_settles_nor_lets_go_its_claim(redis_url: str) -> None:
    """Two processes under one holder name (a fixed ``actor.id``): the first frozen past its lease, the second
    started meanwhile. The first, waking, must not settle the second's claim with its own round: its positions (being
    drawn again by others) would be sent a second time and the second round's positions neither trained nor given
    back, with the equation balanced all the same."""
    frozen, started = transport(redis_url), transport(redis_url)
    frozen.ensure_consumer_group()
    assert frozen.next_prompts(2, "actor-1", 0.2) == [0, 1]
    time.sleep(0.3)
    assert started.next_prompts(3, "actor-1", 60) == [0, 1, 2]  # a new round of that name: the old claim given back
    # The frozen process wakes: more positions for its round, its round's write, letting its round go: all refused
    # or without effect on the claim of the newer round.
    with pytest.raises(ClaimLost):
        frozen.next_prompts(1, "actor-1", 60, new_round=False)
    with pytest.raises(ClaimLost):
        settled(frozen, "actor-1", 2)
    frozen.release_round("actor-1")
    pb = started.prompt_balance()
    assert pb.claims["actor-1"].positions == (0, 1, 2) and frozen.stream_length() == 0, pb.equation()
    assert pb.counters.requeued == {"lost": 2} and pb.counters.sent == 0 and pb.unexplained == 0, pb.equation()
    # The newer process goes on: more for its round, and its write settles its own claim.
    assert started.next_prompts(1, "actor-1", 60, new_round=False) == [3]
    settled(started, "actor-1", 4)
    pb = started.prompt_balance()
    assert "actor-1" not in pb.claims and pb.counters.sent == 4 and pb.unexplained == 0, pb.equation()


def test_a_process_whose_actor_id_a_newer_one_took_is_refused_its_next_draw(redis_url: str) -> None:
    """Two live processes under one ``actor.id``: each new round of either gave back the other's live claim, and
    neither sent. The one that took the id first is refused its next draw, whatever the claims hold, and the newer
    one's rounds are left alone."""
    old, new = transport(redis_url), transport(redis_url)
    old.ensure_consumer_group()
    assert old.take_name("actor-1") == 1
    assert old.next_prompts(2, "actor-1", 60) == [0, 1]
    settled(old, "actor-1", 2)
    assert new.take_name("actor-1") == 2  # started while the first still runs
    assert new.next_prompts(2, "actor-1", 60) == [2, 3]
    with pytest.raises(Superseded, match="actor-1"):
        old.next_prompts(2, "actor-1", 60)  # its next round: the newer one's live claim stays
    with pytest.raises(Superseded):
        old.next_prompts(1, "actor-1/1", 60)  # its other slots' too
    with pytest.raises(Superseded):
        old.next_prompts(1, "actor-1", 60, new_round=False)
    pb = new.prompt_balance()
    assert pb.claims["actor-1"].positions == (2, 3) and not pb.counters.requeued, pb.equation()
    # On its way out it gives back only what is its own: the reservation under the name is the newer one's.
    assert new.reserve_round("actor-1", 2, 0, Admission(100, 2, 4), 60)
    old.release_round("actor-1", reservation=False)
    assert new.client.hexists(new.keys.inflight, "actor-1") and "actor-1" in new.prompt_balance().claims
    settled(new, "actor-1", 2)
    assert new.prompt_balance().counters.sent == 4 and new.prompt_balance().unexplained == 0
    assert isinstance(Superseded("x"), LeaseLost)  # grpo's exit code 5, one line, as for a fenced-out learner


def test_a_heartbeat_renews_only_its_own_rounds_claim(redis_url: str) -> None:
    """A woken process's heartbeat must not keep alive the claim of a newer process under its name: were that newer
    one killed, its positions would wait on the woken one's beats instead of its own lease."""
    frozen, started, other = transport(redis_url), transport(redis_url), transport(redis_url)
    assert frozen.next_prompts(1, "actor-1", 0.2) == [0]
    time.sleep(0.3)
    assert started.next_prompts(2, "actor-1", 0.4) == [0, 1]  # the frozen one's claim given back, a new one taken
    lease_end = started.prompt_balance().claims["actor-1"].lease_end_ms
    frozen.renew_reservation("actor-1", 60)
    assert started.prompt_balance().claims["actor-1"].lease_end_ms == lease_end  # not renewed by the other process
    started.renew_reservation("actor-1", 60)
    assert started.prompt_balance().claims["actor-1"].lease_end_ms > lease_end + 30_000
    assert other.next_prompts(1, "b", 60) == [2]  # renewed: nothing given back


def test_trained_positions_are_marked_once_and_a_second_time_counted(redis_url: str) -> None:
    t = transport(redis_url)
    t.ensure_consumer_group()
    t.next_prompts(3, "a", 5)
    settled(t, "a", 3)
    ids = [e.id for e in t.read("l", 10, 100)]
    t.ack_trained(ids, ["g0", "g1", "g2"], positions=[0, 1, -1])  # the third group carries no position
    t.ack_trained(ids, ["g0", "g1", "g2"], positions=[0, 1, -1])  # a retry after a lost reply counts nothing
    c = t.prompt_balance().counters
    assert (c.trained, c.retrained) == (2, 0) and read_balance(t).trained == 3
    assert t.client.getbit(t.keys.prompts_trained, 1) == 1 and t.client.getbit(t.keys.prompts_trained, 2) == 0
    # The same position trained again in the pass (a bug somewhere upstream): counted, not silent.
    t.produce([b"g"], {"prompts_sent": 0})
    again = [e.id for e in t.read("l", 10, 100)]
    t.ack_trained(again, ["g3"], positions=[1])
    c = t.prompt_balance().counters
    assert (c.trained, c.retrained) == (2, 1)


def test_a_malformed_claim_is_a_schema_error_naming_it(redis_url: str) -> None:
    t = transport(redis_url)
    t.client.hset(t.keys.prompts_claims, "x", "soon 1,2")
    with pytest.raises(SchemaError, match=r"prompts:claims\.x"):
        t.prompt_balance()


def test_the_claim_form_round_trips_as_ranges() -> None:
    claim = PromptClaim(1700000000123, (3, 4, 5, 9, 11, 12))
    assert claim.encode() == "1700000000123 3-5,9,11-12"
    assert PromptClaim.decode(claim.encode()) == claim
    assert PromptClaim.decode("5 ") == PromptClaim(5, ())
    mine = PromptClaim(7, (1, 2), round="9f0c")  # the round holding it, as the draw script writes it
    assert mine.encode() == "7 r9f0c 1-2" and PromptClaim.decode(mine.encode()) == mine
    assert PromptClaim.decode("7 r9f0c ") == PromptClaim(7, (), "9f0c")
    for bad in ("x 1", "5 1,,2", "5 3-1", "5 1-", "5 rx 1", "5 r 1"):
        with pytest.raises(SchemaError):
            PromptClaim.decode(bad)


def test_an_actor_takes_its_id_only_once_no_process_beats_under_it(redis_url: str) -> None:
    """A restarted actor waits for its earlier self's heartbeat to lapse; one configured with a live one's id waits
    for as long as that one lives, and stops waiting when asked to stop."""
    import threading

    from actor.identity import take_actor_id
    from common.liveness import Liveness

    t = transport(redis_url)
    t.heartbeat("actor-1", 0.6, {})
    started = time.monotonic()
    assert take_actor_id(t, "actor-1", threading.Event(), Liveness(60))
    assert time.monotonic() - started >= 0.4 and t.client.hget(t.keys.actor_ids, "actor-1") == b"1"
    t.heartbeat("actor-1", 60, {})  # alive
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    assert not take_actor_id(transport(redis_url), "actor-1", stop, Liveness(60))
    assert t.client.hget(t.keys.actor_ids, "actor-1") == b"1"  # not taken
