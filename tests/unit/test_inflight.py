"""Rounds in flight (actor/rounds.py): slots and their holder names, the oldest round first, each round stamped with
the version its reply was generated with, and one round at a time, inline, where the engine does not batch."""

from __future__ import annotations

import threading
from typing import Any

from actor.engines.base import Capabilities
from actor.rounds import InFlight, rounds_in_flight, sampled_aside
from common.config import load_config
from common.rollout import Sample
from common.tasks import Problem

BATCHING = Capabilities(concurrent_requests=True, rounds_in_flight=4)


class Engine:
    """Replies when released, stamped with the version the test says the server holds."""

    def __init__(self, capabilities: Capabilities = BATCHING) -> None:
        self.capabilities = capabilities
        self.version = 3
        self.served = 3
        self.release = threading.Event()
        self.calls = 0

    def generate(self, prompts: Any, n: int, *, greedy: bool = False) -> list[list[Sample]]:
        self.calls += 1
        return [[Sample([1, 2], [-0.5, -0.5], "stop")] * n for _ in prompts]

    def generate_versioned(
        self, prompts: Any, n: int, *, greedy: bool = False
    ) -> tuple[list[list[Sample]], int | None]:
        self.release.wait(5)
        return self.generate(prompts, n), self.served


def problems(k: int) -> list[Problem]:
    return [Problem(id=f"p{i}", prompt=f"q{i}", reference="1") for i in range(k)]


def test_holders_are_the_actors_id_then_one_per_slot() -> None:
    f = InFlight("a-1", Engine(), 3)
    assert f.holders() == ["a-1", "a-1/1", "a-1/2"] and f.free_holder() == "a-1"
    f.close()


def test_the_oldest_round_comes_first_with_its_replys_version() -> None:
    engine = Engine()
    f = InFlight("a", engine, 2)
    first = f.start(f.free_holder() or "", problems(2), [[5], [6]], 4)
    second = f.start(f.free_holder() or "", problems(1), [[7]], 4)
    assert (first.holder, second.holder, f.free_holder()) == ("a", "a/1", None)
    engine.served = 5  # the server loaded v5 before replying
    beats: list[int] = []
    engine.release.set()
    done = f.finish_oldest(lambda: beats.append(1))
    assert done is first and done.version == 5 and [len(g) for g in done.samples] == [4, 4]
    assert f.free_holder() == "a" and f.finish_oldest(lambda: None) is second
    f.close()
    assert not f.pending


def test_one_round_at_a_time_is_generated_inline() -> None:
    engine = Engine()
    f = InFlight("a", engine, 1)
    engine.version = 7
    rnd = f.start("a", problems(1), [[5]], 2)
    assert engine.calls == 1 and rnd.version == 7 and rnd.future is None  # generated before start returned
    assert f.finish_oldest(lambda: None) is rnd


def test_only_an_engine_that_batches_concurrent_requests_gets_more_than_one(tmp_path: Any) -> None:
    cfg = load_config(None, [], env={})
    assert rounds_in_flight(cfg, Engine()) == 4  # type: ignore[arg-type]
    assert rounds_in_flight(cfg, Engine(Capabilities(False, 4, loads_mid_round=True))) == 1  # type: ignore[arg-type]
    cfg.actor.synchronous = True
    assert rounds_in_flight(cfg, Engine()) == 1  # type: ignore[arg-type]


def test_settling_waits_for_every_round_and_keeps_them_in_order() -> None:
    engine = Engine()
    f = InFlight("a", engine, 2)
    first = f.start("a", problems(1), [[5]], 2)
    second = f.start("a/1", problems(1), [[6]], 2)
    beats: list[int] = []
    threading.Timer(0.5, engine.release.set).start()
    f.settle(lambda: beats.append(1))
    assert beats and all(r.future is not None and r.future.done() for r in (first, second))
    assert f.finish_oldest(lambda: None) is first and f.finish_oldest(lambda: None) is second
    f.close()


def test_with_in_flight_updates_even_one_round_of_a_batching_engine_is_generated_aside() -> None:
    """The actor loads versions into SGLang while it waits for a round (actor.loop._while_sampling): a round generated
    in its own thread would leave it nothing to wait in, and no version would ever land mid-round."""
    cfg = load_config(None, ["sglang.rounds_in_flight=1", "actor.weight_updates=in_flight"], env={})
    engine = Engine(Capabilities(True, 1))
    assert rounds_in_flight(cfg, engine) == 1 and sampled_aside(cfg, engine)  # type: ignore[arg-type]
    local = Engine(Capabilities(loads_mid_round=True))  # the local engine asks between decode steps
    assert not sampled_aside(cfg, local)  # type: ignore[arg-type]
    cfg.actor.weight_updates = "between_rounds"
    assert not sampled_aside(cfg, engine)  # type: ignore[arg-type]
    f = InFlight("a", engine, 1, aside=True)
    waits: list[int] = []
    rnd = f.start("a", problems(1), [[5]], 2)
    assert rnd.future is not None and f.free_holder() is None  # generating in another thread

    def wait() -> None:
        waits.append(1)
        engine.release.set()  # the server replies only once the actor has been waiting

    assert f.finish_oldest(wait) is rnd and waits and engine.calls == 1
    f.close()
