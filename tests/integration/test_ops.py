"""`grpo status` and `grpo dead` (list, show, replay) against a real Redis, through the real CLI."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from common.config import RedisConfig
from common.ports import free_port
from common.schemas import LeaseHolder
from common.transport import Transport, read_balance
from tests.unit.test_schemas import make_group

pytestmark = pytest.mark.integration


def grpo(url: str, *args: str, run: str = "ops") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "common.cli", *args, "-o", f"redis.url={url}", "-o", f"run.name={run}"]
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
    t.client.hincrby(t.keys.stats, "groups_filtered:zero_std", 5)
    t.client.hincrby(t.keys.stats, "groups_produced", 1)  # and one the learner dropped as too stale: still balanced
    t.client.hincrby(t.keys.stats, "groups_dropped:stale", 1)
    t.heartbeat("actor-1", 30, {"version": 3})
    assert "learner: no learner holds the run" in grpo(redis_url, "status").stdout
    assert t.acquire_lease(LeaseHolder(0, "learner-box-4242-ab", "box", 4242, 0.0), 30, floor=0) is None
    assert "difficulty sampling" not in grpo(redis_url, "status").stdout  # the cursor keeps no record
    t.record_outcomes([("add-3-5", "m"), ("add-1-1", "r")], 4, {"taken:unseen": 2, "passed:solved": 3})
    status = grpo(redis_url, "status", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["prompts"] == {"on_record": 2, "choices": {"taken:unseen": 2, "passed:solved": 3}}
    assert report["unexplained"] == 0 and report["dead"] == 2 and report["pending"] == 1
    assert report["discarded"] == {"stopped": 4} and report["dropped"] == {"stale": 1}  # --json keeps the dicts
    assert report["published_version"] is None and report["done"] is False
    assert (report["learner"]["host"], report["learner"]["pid"], report["learner"]["token"]) == ("box", 4242, 1)

    # In lines, every figure is in words: no Python reprs of dicts, None or booleans.
    text = grpo(redis_url, "status")
    assert text.returncode == 0, text.stderr
    assert "dropped 1 (stale 1)  filtered by actors 5 (zero_std 5)  discarded 4 (stopped 4)" in text.stdout
    assert "published version none yet  learner finished: no" in text.stdout
    assert "1 live actor: actor-1 (v3)" in text.stdout
    assert ("difficulty sampling: 2 problems on record; positions taken 2 (unseen 2), passed over 3 (solved 3)"
            in text.stdout)  # fmt: skip
    assert re.search(
        r"learner: held by box pid 4242 \(lease token 1\) since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, its lease "
        r"ends in \d+s unless renewed",
        text.stdout,
    ), text.stdout
    assert not re.search(r"[{}']|\bNone\b|\bTrue\b|\bFalse\b", text.stdout.replace("grpo:{ops}:", "")), text.stdout
    t.close()


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers: a hung Redis (or something that is not one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["dead"]])
def test_queries_fail_fast_when_redis_is_unreachable(command: list[str], silent_port: int) -> None:
    """Services retry (redis.retries, with backoff); a query connects once, with a short timeout, and says why not.
    Before: 11 attempts (about 26 s of backoff against a closed port, minutes against a silent one)."""
    closed = free_port()  # nothing listens there: refused at once
    for url in (f"redis://127.0.0.1:{closed}/0", f"redis://u:secret@127.0.0.1:{silent_port}/0"):
        t0 = time.monotonic()
        done = grpo(url, *command)
        took = time.monotonic() - t0
        assert done.returncode == 2, done.stdout + done.stderr
        line = _one_line(done)
        assert line.startswith(f"grpo {command[0]}: redis at ") and "is unreachable" in line, line
        assert "secret" not in line and done.stdout == ""
        assert took < 10, f"{took:.1f}s: {line}"  # one 3 s attempt, not redis.retries of them (27 s)


def test_a_run_name_redis_never_saw_is_a_users_mistake(redis_url: str) -> None:
    """No identity, counters, stream or dead letters under the name: say so, name the runs Redis knows, exit 2."""
    for run in ("alpha", "beta"):
        t = Transport(RedisConfig(url=redis_url), run)
        if run == "alpha":
            t.create_identity("r-alpha")  # a learner started
        else:
            t.client.hincrby(t.keys.stats, "groups_produced", 0)  # actors only, no learner yet: a run all the same
        t.close()
    for command in (["status"], ["status", "--json"], ["dead"]):
        done = grpo(redis_url, *command, run="alhpa")
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        line = _one_line(done)
        assert f"Redis at {redis_url} has no run named 'alhpa' (runs it knows: alpha, beta)" in line, line
    for run in ("alpha", "beta"):  # the runs it has seen answer as before
        done = grpo(redis_url, "status", run=run)
        assert done.returncode == 0 and f"run {run} " in done.stdout, done.stdout + done.stderr


def test_a_malformed_value_of_the_run_is_one_line(redis_url: str) -> None:
    """A value of the run this build cannot read (written by someone with write access to Redis) is said in one line,
    exit 2, naming the value and what is wrong with it: never a traceback."""
    t = Transport(RedisConfig(url=redis_url), "ops")
    t.client.hset(t.keys.stats, "groups_trained", "many")
    t.client.xadd(t.keys.dead, {"reason": "not msgpack", "payload": b"\x00", "at": "1.5"})  # no script wrote it
    t.close()
    for command, what in ((["status"], "stats.groups_trained: 'many' is not a count"),
                          (["dead"], "missing ['source_id']")):  # fmt: skip
        done = grpo(redis_url, *command)
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        line = _one_line(done)
        assert line.startswith(f"grpo {command[0]}: redis at ") and "holds a malformed value of run" in line, line
        assert what in line, line
