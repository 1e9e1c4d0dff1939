"""grader.name=service without a server: the request it sends, how an answer becomes rewards, which failures are
tried again and how each is counted, and the config keys it takes. The HTTP itself: tests/integration."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import typing
from typing import Any

import pytest

from common.config import ConfigError, load_config
from common.rollout import GraderErrorKind, Sample, sample_texts
from grader.open import open_grader
from grader.pool import GraderPool
from grader.service import ServiceFailure, ServiceGrader, exception_failure, parse_scores, request_body, status_failure


def test_the_request_lists_the_items_in_order_with_null_for_a_missing_prompt() -> None:
    body = request_body(["3+4=", None], ["7", "ünïcode"], ["7", "8"])
    assert json.loads(body) == {
        "items": [
            {"prompt": "3+4=", "completion": "7", "reference": "7"},
            {"prompt": None, "completion": "ünïcode", "reference": "8"},
        ]
    }


def test_scores_are_read_in_item_order_and_one_bad_score_is_zero_and_invalid() -> None:
    assert parse_scores(b'{"scores": [1, 0.25, 0], "why": "ignored"}', 3) == [(1.0, None), (0.25, None), (0.0, None)]
    bad = [1.5, -0.1, "1", None, True, float("nan")]
    answer = json.dumps({"scores": [0.5, *bad]}).encode()  # json.dumps writes NaN, as some servers do
    assert parse_scores(answer, 1 + len(bad)) == [(0.5, None)] + [(0.0, "invalid")] * len(bad)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"<html>busy</html>", "not JSON"),
        (b"\xff\xfe\x00", "not JSON"),
        (b"[0.5, 1]", '"scores" list'),
        (b'{"score": [1, 1]}', '"scores" list'),
        (b'{"scores": "1, 1"}', '"scores" list'),
        (b'{"scores": [1]}', "1 scores for 2 items"),
        (b'{"scores": [1, 1, 0]}', "3 scores for 2 items"),
    ],
)
def test_an_answer_that_breaks_the_contract_is_service_invalid_and_not_retried(answer: bytes, says: str) -> None:
    with pytest.raises(ServiceFailure) as e:
        parse_scores(answer, 2)
    assert e.value.kind == "service_invalid" and not e.value.retry and says in str(e.value)


@pytest.mark.parametrize(
    ("status", "retry"), [(500, True), (502, True), (503, True), (429, True), (400, False), (404, False), (301, False)]
)
def test_http_errors_are_service_http_and_only_5xx_and_429_are_retried(status: int, retry: bool) -> None:
    failure = status_failure(status, b"overloaded\n")
    assert failure is not None and failure.kind == "service_http" and failure.retry is retry
    assert f"HTTP {status} 'overloaded'" in str(failure)
    assert status_failure(200, b"") is None and status_failure(204, b"") is None


@pytest.mark.parametrize(
    ("error", "kind", "retry"),
    [
        (TimeoutError("timed out"), "service_timeout", True),
        (ConnectionRefusedError(111, "Connection refused"), "service_unreachable", True),
        (ConnectionResetError(104, "reset"), "service_unreachable", True),
        (http.client.RemoteDisconnected("closed"), "service_unreachable", True),
        (http.client.IncompleteRead(b"{", 10), "service_unreachable", True),
        (OSError(113, "No route to host"), "service_unreachable", True),
        (http.client.BadStatusLine("SSH-2.0"), "service_invalid", False),
    ],
)
def test_what_an_attempt_that_raised_counts_as(error: Exception, kind: str, retry: bool) -> None:
    failure = exception_failure(error, 2.0)
    assert (failure.kind, failure.retry) == (kind, retry)


def test_a_bug_is_not_counted_as_a_service_failure() -> None:
    with pytest.raises(KeyError):
        exception_failure(KeyError("oops"), 2.0)


def test_the_service_kinds_are_labels_of_the_grader_errors_counter() -> None:
    kinds = set(typing.get_args(GraderErrorKind))
    service = {"service_timeout", "service_unreachable", "service_http", "service_invalid", "service_budget"}
    assert service | {"invalid"} <= kinds


def test_the_service_keys_of_the_config() -> None:
    cfg = load_config(overrides=["grader.name=service", "grader.url=http://judge:8000/score?v=1"], env={}).grader
    assert (cfg.url, cfg.batch_size, cfg.retries, cfg.retry_backoff_s, cfg.timeout_s, cfg.round_budget_s) == (
        "http://judge:8000/score?v=1", 16, 2, 0.5, 5.0, 0.0
    )  # fmt: skip
    with open_grader(cfg) as grader:
        assert isinstance(grader, ServiceGrader) and grader.name == "service"
        assert grader.where == "http://judge:8000/score"  # logs leave the query (an API key, say) out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grader.name=service"], r"grader\.url: grader\.name=service needs the scorer's URL"),
        (["grader.name=service", "grader.url=judge:8000"], r"grader\.url: .*the scheme must be http or https"),
        (["grader.name=service", "grader.url=ftp://judge/"], r"grader\.url: .*the scheme must be http or https"),
        (["grader.name=service", "grader.url=http:///score"], r"grader\.url: .*names no host"),
        (["grader.name=service", "grader.url=http://judge:99999/"], r"grader\.url: .*not a URL"),
        (["grader.name=service", "grader.url=http://j/", "grader.batch_size=0"], r"grader\.batch_size"),
        (["grader.name=service", "grader.url=http://j/", "grader.retries=-1"], r"grader\.retries"),
        (["grader.name=service", "grader.url=http://j/", "grader.retry_backoff_s=-1"], r"grader\.retry_backoff_s"),
        (["grader.name=service", "grader.url=http://j/", "grader.round_budget_s=-1"], r"grader\.round_budget_s"),
        (["grader.name=gsm8k", "grader.url=http://j/"], r"grader\.url: only used with grader\.name=service"),
        (["grader.batch_size=4"], r"grader\.batch_size: only used with grader\.name=service"),
        (["grader.retries=5"], r"grader\.retries: only used with grader\.name=service"),
        (["grader.name=exact", "grader.retry_backoff_s=2"], r"grader\.retry_backoff_s: only used with"),
        (["grader.round_budget_s=60"], r"grader\.round_budget_s: only used with grader\.name=service"),
        (["grader.name=combine", "grader.components=[{name: service}]"], r"grader\.components\.0\.name"),
    ],
)
def test_service_options_are_checked_in_the_config(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides, env={})


def test_a_resolved_config_with_every_key_written_out_loads_again() -> None:
    """config.json holds every key at its value: the service keys at their defaults do not trip other graders."""
    service = ["grader.name=service", "grader.url=https://judge.example/v1/score", "grader.retries=0"]
    for overrides in ([], service, [*service, "grader.round_budget_s=120"]):
        cfg = load_config(overrides=overrides, env={})
        grader = cfg.grader.model_dump()
        assert type(cfg.grader).model_validate(grader) == cfg.grader


def test_a_resolver_that_never_answers_costs_each_attempt_its_time_limit_and_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """getaddrinfo takes no time-out: a lookup that hangs is waited on for the attempt's time alone, and the retry
    waits on the same lookup rather than starting another (a hung resolver holds one thread per host)."""
    release = threading.Event()
    asked: list[str] = []

    def hung(host: str, *args: Any, **kw: Any) -> Any:
        asked.append(host)
        release.wait(5)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    timeout_s, backoff_s = 0.3, 0.05
    grader = ServiceGrader("http://judge.example:8000/score", timeout_s=timeout_s, retries=1, retry_backoff_s=backoff_s)
    t0 = time.monotonic()
    try:
        result = grader.grade([("1", "1"), ("2", "3")])
    finally:
        release.set()
    took = time.monotonic() - t0
    assert result.scores == [0.0, 0.0] and result.errors == {"service_timeout": 2}
    least = 2 * timeout_s + backoff_s
    assert least - 0.05 <= took < least + 1.5, took
    assert asked == ["judge.example"]


def test_a_round_s_budget_is_its_setting_or_each_batch_s_first_attempt_and_one_batch_s_retries() -> None:
    grader = ServiceGrader("http://judge/", timeout_s=5.0, retries=2, retry_backoff_s=0.5)
    assert grader.round_budget(1) == 5.0 * 3 + 0.5 + 1.0  # one batch: all its attempts and backoffs, as before
    assert grader.round_budget(8) == 5.0 * (8 + 2) + 0.5 + 1.0
    assert ServiceGrader("http://judge/", round_budget_s=30.0).round_budget(8) == 30.0


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("0") + i) if i < 10 else "<pad>" for i in ids)


def test_the_pool_grades_the_sample_texts_and_takes_prompts_it_does_not_use() -> None:
    """One function says what text an answer is graded as (the service sends the same: tests/integration)."""
    eos = 11
    samples = [
        Sample([4, 2, eos], [-0.1] * 3, "stop"),
        Sample([4], [-0.1], "length"),
        Sample([7, 10, eos], [-1] * 3, "stop"),
    ]
    assert sample_texts(_Tok(), samples) == ["42", "4", "7<pad>"]
    with GraderPool("addition", isolation="inline") as pool:
        graded = pool.grade_samples(_Tok(), samples, ["42", "4", "7"], require_stop=False, prompts=["a", "b", "c"])
    assert graded.scores == [1.0, 1.0, 0.0]
