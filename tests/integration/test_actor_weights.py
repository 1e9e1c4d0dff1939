"""An actor facing bad announcements, on a real Redis with a real local engine: a malformed ``weights:latest`` is
said once per value and counted, a version that cannot be loaded is counted and tried again with backoff, not every
round, and neither changes the weights the actor samples with."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from actor.engines.local import LocalEngine
from actor.loop import Actor
from actor.weights.mid_round import Backoff
from common.config import RedisConfig, load_config
from common.metrics import ActorMetrics
from common.schemas import WeightsAnnouncement
from common.transport import Transport
from common.weights import publish
from tests.conftest import wrong_shaped_copy

pytestmark = pytest.mark.integration


def make_actor(model: Path, run_dir: Path, url: str) -> Actor:
    cfg = load_config(None, [f"model.path={model}", f"run.dir={run_dir}", f"redis.url={url}", "run.name=aw"])
    transport = Transport(cfg.redis, cfg.run.name)
    registry = CollectorRegistry()
    actor = Actor(cfg, "actor-w", transport, LocalEngine(cfg, seed=0), None, ActorMetrics(registry))  # type: ignore[arg-type]
    actor._pubsub = transport.subscribe_weights()
    actor.registry = registry  # type: ignore[attr-defined]
    return actor


def counted(actor: Actor, name: str, **labels: str) -> float:
    return actor.registry.get_sample_value(name, labels or None) or 0.0  # type: ignore[attr-defined]


def test_a_malformed_announcement_is_ignored_once_per_value_and_counted(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    actor = make_actor(tiny_model_dir, tmp_path, redis_url)
    t = Transport(RedisConfig(url=redis_url), "aw")
    before = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}
    good = WeightsAnnouncement(4, str(tmp_path / "weights" / "v000004"), "xxh3-128:" + "a" * 32).to_hash()
    bad = [{"digest": "md5:" + "a" * 32}, {"version": "four"}, {"format": "hf-safetensors-v9"}, {"uri": b"\xff"}]
    for change in bad:
        t.client.delete(t.keys.weights_latest)
        t.client.hset(t.keys.weights_latest, mapping={**good, **change})
        for _ in range(5):  # every round reads it again: said and counted once
            actor.reload_weights()
            assert actor.disk.announced() is None
    t.client.delete(t.keys.weights_latest)
    t.client.hset(t.keys.weights_latest, mapping={k: v for k, v in good.items() if k != "uri"})
    actor.reload_weights()
    assert counted(actor, "grpo_actor_weight_announcements_malformed_total") == len(bad) + 1
    said = [r.getMessage() for r in caplog.records if "ignoring weights:latest" in r.getMessage()]
    assert len(said) == len(bad) + 1 and all("\n" not in m for m in said)
    assert actor.engine.version == 0
    assert all(torch.equal(before[k], v) for k, v in actor.engine.model.state_dict().items())

    # The learner's next announcement replaces the garbage, and the actor loads it.
    from transformers import AutoModelForCausalLM

    pub = publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None, actor.cfg.weights.dir, 5, keep=2)
    t.announce_weights(pub.announcement)
    actor.reload_weights()
    assert actor.engine.version == 5


def test_a_version_that_cannot_be_loaded_is_tried_again_with_backoff(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    actor = make_actor(tiny_model_dir, tmp_path, redis_url)
    t = Transport(RedisConfig(url=redis_url), "aw")
    tries: list[int] = []
    load = actor.engine.load

    def counting_load(ann: WeightsAnnouncement) -> int:
        tries.append(ann.version)
        return load(ann)

    actor.engine.load = counting_load  # type: ignore[method-assign]
    root = Path(actor.cfg.weights.dir)
    good = publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None, root, 2, keep=3).announcement
    cases: list[tuple[str, Any]] = [
        ("mismatch", wrong_shaped_copy(good, root / "v000003", 3, extra=5)),
        ("path", publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None, tmp_path / "other", 4, keep=2)
         .announcement),
    ]  # fmt: skip
    for reason, ann in cases:
        t.announce_weights(ann)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.8:  # rounds as fast as they come: at most two tries in the first second
            actor.reload_weights()
        assert tries.count(ann.version) == 2, (reason, tries)
        assert counted(actor, "grpo_actor_weight_load_failures_total", reason=reason) == 2
        assert actor.engine.version == 0
    time.sleep(1.1)  # the backoff of the last one has passed: it is tried once more
    actor.reload_weights()
    actor.reload_weights()
    assert tries.count(4) == 3
    t.announce_weights(good)  # a new announcement is tried at once
    actor.reload_weights()
    assert actor.engine.version == 2


def test_backoff_doubles_up_to_its_bound_and_starts_over_for_another_announcement() -> None:
    b = Backoff(first=1.0, most=4.0)
    delays = [b.failed("v3", now=0.0) for _ in range(6)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.waiting("v3", now=3.9) and not b.waiting("v3", now=4.0) and not b.waiting("v4", now=0.0)
    assert b.failed("v4", now=10.0) == 0.0 and b.attempts == 1
