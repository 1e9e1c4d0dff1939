"""Replies with which Redis refuses a command for now (common.transport.refusals), in the forms redis-py raises them:
the texts are redis-server 6.2's as tests/integration/test_redis_refusals.py met them, and Redis 7's forms; and the
wait of Connection._do (paced, bounded, logged, counted) with a call that fails in memory, no Redis."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
from redis._parsers.base import BaseParser

from common.config import RedisConfig
from common.transport import RedisUnavailable, refusal
from common.transport.connection import Connection
from common.transport.refusals import refusal_attempts, refusal_pause

OOM = "OOM command not allowed when used memory > 'maxmemory'."


def reply(text: str) -> redis.RedisError:
    """The exception redis-py raises for an error reply ``-<text>``."""
    return BaseParser.parse_error(text)


def in_pipeline(error: redis.RedisError, command: str) -> redis.RedisError:
    """As redis-py raises a queued command's error from a pipeline or a transaction."""
    error.args = (f"Command # 1 ({command}) of pipeline caused error: {error.args[0]}",)
    return error


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (reply(OOM), "OOM"),  # a plain command
        (in_pipeline(reply(OOM), "HGETALL grpo:{r}:stats"), "OOM"),  # queued in MULTI: the transaction was discarded
        (reply("EXECABORT Transaction discarded because of: " + OOM), "OOM"),  # EXEC itself refused
        # Redis before 7: a script's call refused, wrapped in the script's error (the plain ERR form)...
        (
            reply(
                "ERR Error running script (call to f_915b64d59d38bb727dc9f6d06639d29634553a75): @user_script:1: "
                "@user_script: 1: -" + OOM
            ),
            "OOM",
        ),
        # ...and returned by a script that caught it (redis.pcall) and passed it on
        (reply("@user_script: 1: -" + OOM), "OOM"),
        (reply(OOM + " script: 915b64d59d38bb727dc9f6d06639d29634553a75, on @user_script:1."), "OOM"),  # Redis 7
        (
            in_pipeline(
                reply("ERR Error running script (call to f_11a9): @user_script:1: @user_script: 1: -" + OOM),
                "EVALSHA 11a9 1 k",
            ),
            "OOM",
        ),
        (reply("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."), "BUSY"),
        (
            reply(
                "MISCONF Redis is configured to save RDB snapshots, but it is currently not able to persist on disk."
            ),
            "MISCONF",
        ),
        (in_pipeline(reply("NOREPLICAS Not enough good replicas to write."), "SET a 2"), "NOREPLICAS"),
        (
            reply(
                "ERR Error running script (call to f_fdc0): @user_script:1: @user_script: 1: -NOREPLICAS Not enough "
                "good replicas to write."
            ),
            "NOREPLICAS",
        ),
        (reply("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."), "MASTERDOWN"),
        (reply("CLUSTERDOWN The cluster is down"), "CLUSTERDOWN"),
        (reply("TRYAGAIN Multiple keys request during rehashing of slot"), "TRYAGAIN"),
    ],
)
def test_a_refusal_is_recognised_in_every_form(error: redis.RedisError, code: str) -> None:
    found = refusal(error)
    assert found is not None and found.code == code, error
    assert found.what and found.fix


@pytest.mark.parametrize(
    "error",
    [
        reply("EXECABORT Transaction discarded because of previous errors."),  # no word of why: not retried blind
        reply("BUSYGROUP Consumer Group name already exists"),
        reply("WRONGTYPE Operation against a key holding the wrong kind of value"),
        reply("NOGROUP No such key 'grpo:{r}:groups' or consumer group 'learners'"),
        reply("GRPO_FENCED the run is held by lease token 7"),  # the fence's: a lost lease, never waited out
        reply("oversized: a message of 9 bytes, over the limit of 8"),
        reply("ERR Error running script (call to f_1): @user_script:3: user_script:3: attempt to compare nil"),
        reply(
            "ERR Error running script (call to f_1): @user_script:1: @user_script: 1: -WRONGTYPE Operation against "
            "a key holding the wrong kind of value"
        ),
        in_pipeline(reply("WRONGTYPE Operation against a key"), "SET BUSY OOM"),  # a code among the command's words
        reply("READONLY You can't write against a read only replica."),  # Sentinel's pool reconnects on it
        reply("NOSCRIPT No matching script. Please use EVAL."),  # redis-py loads the script and calls it again
        reply("LOADING Redis is loading the dataset in memory"),  # a ConnectionError: the reconnect policy's
        redis.ConnectionError("Connection refused"),
        redis.TimeoutError("Timeout reading from 127.0.0.1:6379"),
        ValueError("not Redis's"),
    ],
)
def test_other_errors_are_no_refusal(error: Exception) -> None:
    assert refusal(error) is None


def test_the_pauses_double_up_to_the_backoff_and_the_attempts_fill_the_bound() -> None:
    assert [refusal_pause(i, 5) for i in range(1, 9)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert refusal_pause(10_000, 5) == 5.0  # no overflow, however long Redis stays full
    # The defaults: 6.3 s of doubling pauses, then 119 of 5 s (the last one past 600 s by 1.3 s): 126 attempts.
    assert refusal_attempts(600, 5) == 126
    assert sum(refusal_pause(i, 5) for i in range(1, 126)) >= 600 > sum(refusal_pause(i, 5) for i in range(1, 125))
    assert refusal_attempts(1, 5) == 5  # 0.1 + 0.2 + 0.4 + 0.8
    assert refusal_attempts(0.3, 0.1) == 4
    assert refusal_attempts(0, 5) == 1  # redis.full_wait_s 0: no wait, one attempt
    assert refusal_attempts(600, 0.001) == 600_001  # (counted, not listed)
    assert sum(refusal_pause(i, 5) for i in range(1, refusal_attempts(40, 5))) >= 40  # the fault test's 40 s


class Refused:
    """A call that Redis refuses ``times`` times (full), then answers."""

    def __init__(self, times: int, error: redis.RedisError | None = None):
        self.left = times
        self.calls = 0
        self.error = error or reply(OOM)

    def __call__(self) -> str:
        self.calls += 1
        if self.left > 0:
            self.left -= 1
            raise self.error
        return "OK"


def connection(wait_s: float, errors: list[int]) -> Connection:
    """No connection is opened until a command is sent, and none is here."""
    cfg = RedisConfig(url="redis://127.0.0.1:1/0", full_wait_s=wait_s, backoff_max_s=0.1)
    return Connection(cfg, "r", on_error=lambda: errors.append(1))


def test_a_refused_call_is_made_again_until_redis_serves_it(caplog: pytest.LogCaptureFixture) -> None:
    errors: list[int] = []
    call = Refused(3)
    with caplog.at_level(logging.WARNING, logger="common.transport"):
        assert connection(1.0, errors)._do(call) == "OK"
    assert call.calls == 4 and len(errors) == 3  # every refused attempt counts as a Redis error
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("Redis is full" in line and "raise maxmemory" in line for line in lines), lines
    assert "attempt 1/11, waiting 0.1s" in lines[0] and "attempt 3/11, waiting" in lines[2], lines


def test_past_the_bound_one_line_and_a_connection_error(caplog: pytest.LogCaptureFixture) -> None:
    errors: list[int] = []
    call = Refused(1000, reply("ERR Error running script (call to f_1): @user_script:1: @user_script: 1: -" + OOM))
    with caplog.at_level(logging.WARNING, logger="common.transport"), pytest.raises(RedisUnavailable) as raised:
        connection(0.3, errors)._do(call)
    attempts = refusal_attempts(0.3, 0.1)
    assert call.calls == attempts == len(errors)
    assert f"attempt {attempts}/{attempts}, giving up" in caplog.records[-1].getMessage()
    line = str(raised.value)
    assert "Redis is full" in line and "redis.full_wait_s (0.3s)" in line and "raise maxmemory" in line, line
    assert "\n" not in line
    # Exit code 3 as for a Redis lost (common.cli), and never taken for a reply's error by a ResponseError handler.
    assert isinstance(raised.value, redis.ConnectionError) and not isinstance(raised.value, redis.ResponseError)


def test_once_a_call_gave_up_the_next_refused_one_does_at_once() -> None:
    """The process is stopping: a heartbeat thread's call refused meanwhile must not wait as long again."""
    errors: list[int] = []
    c = connection(0.3, errors)
    with pytest.raises(RedisUnavailable):
        c._do(Refused(1000))
    assert c._do(Refused(0)) == "OK"  # what Redis serves is still served
    refused = Refused(1000)
    with pytest.raises(RedisUnavailable):
        c._do(refused)
    assert refused.calls == 1


def test_any_other_error_is_raised_at_once() -> None:
    errors: list[int] = []
    call = Refused(5, reply("WRONGTYPE Operation against a key holding the wrong kind of value"))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        connection(10.0, errors)._do(call)
    assert call.calls == 1 and len(errors) == 1


def test_every_pipeline_of_the_transport_is_built_anew_for_each_attempt() -> None:
    """A pipeline built once and sent through Connection._do would be sent empty by the retry after a refusal (redis-py
    empties a pipeline once it has run): every batch goes through Connection._batch, which builds it per attempt."""
    transport = Path(__file__).resolve().parents[2] / "common" / "transport"
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(transport.glob("*.py"))
        if path.name != "connection.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ".pipeline(" in line or "pipe.execute" in line
    ]
    assert not found, "pipelines outside Connection._batch:\n" + "\n".join(found)
