"""`grpo status` and `grpo dead` (list, show, replay) against a real Redis, through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.config import RedisConfig
from common.transport import Transport, read_balance
from tests.unit.test_schemas import make_group

pytestmark = pytest.mark.integration


def grpo(url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "common.cli", *args, "-o", f"redis.url={url}", "-o", "run.name=ops"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_read_and_replay_dead_letters(redis_url: str) -> None:
    from common.schemas import encode_group

    t = Transport(RedisConfig(url=redis_url), "ops")
    t.ensure_consumer_group()
    good = encode_group(make_group())
    t.produce([b"\x00garbage", good])
    entries = t.read("learner-x", 10, 100)
    for e in entries:  # as a learner whose model did not fit these would: both rejected
        t.dead_letter(e, "token id 50000 outside the model's vocabulary of 64" if e.payload == good else "not msgpack")

    listed = grpo(redis_url, "dead")
    assert listed.returncode == 0, listed.stderr
    assert "2 dead letters" in listed.stdout and "outside the model's vocabulary" in listed.stdout
    dead_ids = [e.id for e in t.dead_letters(10)]
    shown = grpo(redis_url, "dead", "--show", dead_ids[1])
    assert "decodes now as a group: prompt add-3-5" in shown.stdout and good.hex()[:40] in shown.stdout

    replayed = grpo(redis_url, "dead", "--replay", dead_ids[1])
    assert replayed.returncode == 0 and "replayed 1 of 1" in replayed.stdout, replayed.stderr
    assert [e.payload for e in t.read("learner-x", 10, 100)] == [good]  # back in the stream, unread
    b = read_balance(t)
    assert (b.produced, b.dead, b.unread, b.unexplained) == (3, 2, 0, 0)  # read just now: pending
    assert t.stats()["groups_replayed"] == 1 and len(t.dead_letters(10)) == 1
    assert grpo(redis_url, "dead", "--replay", dead_ids[1]).returncode == 1  # gone: nothing replayed twice

    t.client.hincrby(t.keys.stats, "groups_discarded:stopped", 4)  # as an actor stopped with no room counts it
    status = grpo(redis_url, "status", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["unexplained"] == 0 and report["dead"] == 2 and report["pending"] == 1
    assert report["discarded"] == {"stopped": 4}
    assert "discarded {'stopped': 4}" in grpo(redis_url, "status").stdout
    t.close()
