"""grader.name=service against a real HTTP scorer on loopback (http.server in a thread of the test): batches, scores in
order, retries, time-outs, a server that is down or answers garbage, and an actor that goes on with a failing one."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from common.children import wait_until
from common.config import RedisConfig, load_config
from common.metrics import gather_endpoints
from common.ports import free_port
from common.rollout import Sample
from common.schemas import decode_group
from common.tasks import Problem
from common.tasks.evaluation import score_problems
from common.transport import Transport
from grader.open import open_grader
from grader.service import ServiceGrader
from tests.integration.test_actor_flow import sim_actor
from tests.integration.test_actor_process import metric

pytestmark = pytest.mark.integration

PAIRS = [(str(i), str(i if i % 3 else i + 1)) for i in range(7)]  # every third answer is wrong
RIGHT = [1.0 if c == r else 0.0 for c, r in PAIRS]


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # each handler thread is joined by server_close: none outlives the test
    block_on_close = True


def scores_of(request: dict[str, Any]) -> bytes:
    scores = [1.0 if it["completion"] == it["reference"] else 0.0 for it in request["items"]]
    return json.dumps({"scores": scores}).encode()


class Scorer:
    """A scorer: 1.0 when the completion equals the reference. ``script`` says what the next requests get instead,
    in order: an HTTP status, "hang" (read the request, never answer), "garbage" (200 and not JSON), "dribble" (200,
    then a byte of the body now and then), "trickle_status" or "trickle_headers" (the status line, or a header, a
    byte every 0.1 s for 4 s, so that each read the grader makes returns well within its time-out; then the scores)
    or "slow" (the scores after 0.4 s); ``always`` the same for every request."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.script: list[int | str] = []
        self.always: int | str | None = None
        self.released = threading.Event()  # set at teardown: a hung handler returns
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/score"

    def next_reply(self, request: dict[str, Any]) -> int | str | None:
        with self.lock:
            self.requests.append(request)
            return self.script.pop(0) if self.script else self.always

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        scorer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                reply = scorer.next_reply(request)
                if reply == "hang":
                    scorer.released.wait(60)
                elif reply == "dribble":
                    self._dribble()
                elif reply in ("trickle_status", "trickle_headers"):
                    self._trickle(request, headers=reply == "trickle_headers")
                elif reply == "slow":
                    scorer.released.wait(0.4)
                    self._scores(request)
                elif reply == "garbage":
                    self._send(200, b"<html>Bad gateway</html>")
                elif isinstance(reply, int):
                    self._send(reply, b"scorer says no")
                else:
                    self._scores(request)

            def _scores(self, request: dict[str, Any]) -> None:
                self._send(200, scores_of(request))

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _dribble(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    while not scorer.released.wait(0.1):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                except OSError:  # the grader gave up and closed the connection
                    pass

            def _trickle(self, request: dict[str, Any], headers: bool) -> None:
                """The status line, or a header after it, a byte every 0.1 s for 4 s, then the rest of the answer."""
                status = b"HTTP/1.1 200 " + b"K" * 27 + b"\r\n"  # a long reason phrase: 42 bytes
                fast, slow = (status, b"X-Wait: " + b"." * 32 + b"\r\n") if headers else (b"", status)
                body = scores_of(request)
                try:
                    self.wfile.write(fast)
                    for i in range(len(slow)):
                        if scorer.released.wait(0.1):
                            return
                        self.wfile.write(slow[i : i + 1])
                    self.wfile.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                except OSError:  # the grader gave up and closed the connection
                    pass
                self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def scorer() -> Iterator[Scorer]:
    s = Scorer()
    try:
        yield s
    finally:
        s.close()


def service(url: str, **kw: Any) -> ServiceGrader:
    return ServiceGrader(url, **{"timeout_s": 5.0, "batch_size": 3, "retries": 2, "retry_backoff_s": 0.01, **kw})


def test_scores_come_back_in_order_one_request_per_batch(scorer: Scorer) -> None:
    prompts = [f"what is {i}?" for i in range(len(PAIRS))]
    result = service(scorer.url).grade(PAIRS, prompts)
    assert result.scores == RIGHT and not result.errors
    assert [len(r["items"]) for r in scorer.requests] == [3, 3, 1]
    sent = [item for r in scorer.requests for item in r["items"]]
    assert sent == [{"prompt": p, "completion": c, "reference": r} for p, (c, r) in zip(prompts, PAIRS, strict=True)]
    service(scorer.url, batch_size=16).grade(PAIRS)  # no prompts: null each
    assert len(scorer.requests) == 4 and [it["prompt"] for it in scorer.requests[-1]["items"]] == [None] * 7


def test_a_busy_scorer_is_tried_again_until_it_answers(scorer: Scorer) -> None:
    scorer.script = [503, 429, 502]  # the first batch: three failures, then it gets its scores on the 4th try
    result = service(scorer.url, retries=3).grade(PAIRS)
    assert result.scores == RIGHT and not result.errors
    assert len(scorer.requests) == 3 + 3


def test_a_scorer_that_stays_broken_costs_only_its_batch(scorer: Scorer) -> None:
    scorer.script = [500, 500, 500]  # 1 + 2 retries, all failed: the first batch scores 0; the others go on
    result = service(scorer.url).grade(PAIRS)
    assert result.scores == [0.0] * 3 + RIGHT[3:]
    assert result.errors == {"service_http": 3}
    assert len(scorer.requests) == 3 + 2


def test_a_4xx_is_not_retried(scorer: Scorer) -> None:
    scorer.always = 422
    result = service(scorer.url, batch_size=16).grade(PAIRS)
    assert result.scores == [0.0] * 7 and result.errors == {"service_http": 7}
    assert len(scorer.requests) == 1


def test_garbage_is_service_invalid_and_not_retried(scorer: Scorer) -> None:
    scorer.script = ["garbage"]
    result = service(scorer.url).grade(PAIRS)
    assert result.scores == [0.0] * 3 + RIGHT[3:] and result.errors == {"service_invalid": 3}
    assert len(scorer.requests) == 3


@pytest.mark.parametrize("reply", ["hang", "dribble", "trickle_status", "trickle_headers"])
def test_a_scorer_that_never_finishes_answering_is_cut_at_the_time_limit(scorer: Scorer, reply: str) -> None:
    """grader.timeout_s holds for a whole attempt, whatever part of the answer the scorer is slow to send: a status
    line or header trickled a byte at a time (each read returning within the socket's time-out) is cut as a body is."""
    scorer.always = reply
    timeout_s, retries, backoff_s = 0.5, 2, 0.1
    t0 = time.monotonic()
    result = service(scorer.url, batch_size=16, timeout_s=timeout_s, retries=retries, retry_backoff_s=backoff_s).grade(
        PAIRS
    )
    took = time.monotonic() - t0
    assert result.scores == [0.0] * 7 and result.errors == {"service_timeout": 7}
    assert len(scorer.requests) == 1 + retries
    least = timeout_s * (1 + retries) + backoff_s * (1 + 2)
    assert least <= took < least + 2.5, took


def test_an_https_scorer_that_trickles_its_handshake_is_cut_at_the_time_limit() -> None:
    """https:// takes its socket from the same bounded connect and watchdog: a server that sends the start of a TLS
    record and then a byte every 0.1 s (each read returns in time, the handshake never completes) is cut."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)  # accept gives up, and the thread ends, should the grader never connect
    released = threading.Event()

    def trickle() -> None:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):  # OSError: the grader gave up and closed the connection
            conn.recv(4096)  # its ClientHello
            conn.sendall(b"\x16\x03\x03\x40\x00")  # a handshake record of 16 KiB follows...
            while not released.wait(0.1):
                conn.sendall(b"\x02")

    thread = threading.Thread(target=trickle)
    thread.start()
    timeout_s = 0.5
    try:
        t0 = time.monotonic()
        url = f"https://127.0.0.1:{server.getsockname()[1]}/score"
        result = service(url, retries=0, timeout_s=timeout_s).grade(PAIRS[:2])
        took = time.monotonic() - t0
    finally:
        released.set()
        thread.join()
        server.close()
    assert result.scores == [0.0, 0.0] and result.errors == {"service_timeout": 2}
    assert timeout_s <= took < timeout_s + 1.5, took


def test_a_round_stops_at_its_budget_and_counts_the_batches_it_did_not_send(scorer: Scorer) -> None:
    """A scorer that answers each batch well within grader.timeout_s, but so slowly that the round's batches take
    longer than grader.round_budget_s: the batch in flight at the budget is cut (service_timeout), the rest are not
    sent (service_budget), and the round ends at the budget."""
    scorer.always = "slow"  # 0.4 s a batch: 7 batches would take 2.8 s
    budget_s = 1.0
    t0 = time.monotonic()
    result = service(scorer.url, batch_size=1, timeout_s=2.0, round_budget_s=budget_s).grade(PAIRS)
    took = time.monotonic() - t0
    assert budget_s <= took < budget_s + 1.5, took
    sent = len(scorer.requests)
    assert 1 <= sent <= 3, sent  # each batch takes 0.4 s: a third could not be done by 1.0 s
    assert result.errors.get("service_budget") == len(PAIRS) - sent, result.errors
    assert set(result.errors) <= {"service_timeout", "service_budget"} and result.errors.get("service_timeout", 0) <= 1
    scored = len(PAIRS) - sum(result.errors.values())
    assert scored >= sent - 1 and result.scores == RIGHT[:scored] + [0.0] * (len(PAIRS) - scored)


def test_by_default_a_round_has_each_batch_s_first_attempt_and_one_batch_s_retries(scorer: Scorer) -> None:
    """grader.round_budget_s 0: (batches + retries) x timeout_s + one batch's backoffs. Against a scorer that never
    answers, the first batches spend it on their retries and the last is not sent, where each batch would otherwise
    have had its own retries (4 batches x 2 attempts x 0.4 s)."""
    scorer.always = "hang"
    timeout_s, retries, backoff_s = 0.4, 1, 0.05
    grader = service(scorer.url, batch_size=2, timeout_s=timeout_s, retries=retries, retry_backoff_s=backoff_s)
    budget_s = (4 + retries) * timeout_s + backoff_s  # 2.05 s: the third batch is in flight then, the fourth unsent
    assert grader.round_budget(4) == pytest.approx(budget_s)
    t0 = time.monotonic()
    result = grader.grade(PAIRS)
    took = time.monotonic() - t0
    assert budget_s - backoff_s <= took < budget_s + 1.5, took  # a retry whose backoff passes the budget is not made
    assert result.errors == {"service_timeout": 6, "service_budget": 1} and result.scores == [0.0] * len(PAIRS)
    assert len(scorer.requests) <= 2 * 2 + 1


def test_a_scorer_that_is_down_is_service_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens: each connection is refused
    t0 = time.monotonic()
    result = service(url, batch_size=4, retry_backoff_s=0.05).grade(PAIRS)
    assert result.scores == [0.0] * 7 and result.errors == {"service_unreachable": 7}
    assert time.monotonic() - t0 < 2  # two batches, each with two backoffs (0.05 s, 0.1 s): refused at once


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("0") + i) if i < 10 else "<pad>" for i in ids)


def test_open_grader_gives_a_service_that_grades_samples_with_their_prompts(scorer: Scorer) -> None:
    cfg = load_config(overrides=["grader.name=service", f"grader.url={scorer.url}", "grader.batch_size=2"], env={})
    eos = 11
    samples = [
        Sample([4, eos], [-0.1] * 2, "stop"),
        Sample([5], [-0.1], "length"),
        Sample([6, eos], [-0.1] * 2, "stop"),
    ]
    with open_grader(cfg.grader) as grader:
        strict = grader.grade_samples(_Tok(), samples, ["4", "5", "7"], require_stop=True, prompts=["a", "b", "c"])
        lax = grader.grade_samples(_Tok(), samples, ["4", "5", "7"], require_stop=False)
    assert strict.scores == [1.0, 0.0, 0.0] and lax.scores == [1.0, 1.0, 0.0]
    # A cut-off answer scores 0 whatever the scorer says: with require_stop it is not sent at all.
    assert [[it["completion"] for it in r["items"]] for r in scorer.requests] == [["4", "6"], ["4", "5"], ["6"]]
    assert [it["prompt"] for it in scorer.requests[0]["items"]] == ["a", "c"]


def test_evaluation_sends_each_problem_s_prompt(scorer: Scorer) -> None:
    eos = 11
    problems = [Problem("a", "1+1=", "2"), Problem("b", "2+2=", "4")]

    def generate(prompts: Any, n: int, greedy: bool, _problems: Any) -> list[list[Sample]]:
        return [[Sample([2, eos], [-0.1] * 2, "stop") for _ in range(n)] for _ in prompts]

    scores = score_problems(problems, lambda _: [1], generate, service(scorer.url, batch_size=16), _Tok(), n=2,
                            batch=8, require_stop=True)  # fmt: skip
    assert scores.greedy == [1.0, 0.0] and scores.sampled == [[1.0, 1.0], [0.0, 0.0]] and not scores.errors
    sent = [[it["prompt"] for it in r["items"]] for r in scorer.requests]
    assert sent == [["1+1=", "2+2="], ["1+1=", "1+1=", "2+2=", "2+2="]]


def test_an_actor_goes_on_with_a_failing_scorer_and_counts_why(
    scorer: Scorer, tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes: Any
) -> None:
    """Every round is graded by a scorer that answers 503: each answer scores 0 and is counted as service_http, and
    the groups flow (the zero-std filter is off, so all-zero groups are sent)."""
    scorer.always = 503
    t = Transport(RedisConfig(url=redis_url), "it")
    grader = ["grader.name=service", f"grader.url={scorer.url}", "grader.retries=1", "grader.retry_backoff_s=0",
              "grader.timeout_s=2", "task.require_stop=false"]  # fmt: skip
    proc = processes.grpo(*sim_actor(tiny_model_dir, tmp_path, redis_url, *grader), log=tmp_path / "actor.log")
    log = tmp_path / "actor.log"
    assert wait_until(lambda: t.stream_length() >= 8, 120), log.read_text()  # two rounds of 4 groups
    assert proc.poll() is None, log.read_text()
    url = gather_endpoints(tmp_path)[0]["metrics_url"]
    failed = metric(url, 'grpo_actor_grader_errors_total{kind="service_http"}') or 0.0
    # Rounds of 4 prompts x 8 answers, in batches of 16, each tried twice: every answer counted, by its reason.
    assert failed >= 64 and failed % 32 == 0, failed
    assert len(scorer.requests) >= failed / 16 * 2
    assert metric(url, 'grpo_actor_grader_errors_total{kind="service_unreachable"}') == 0.0
    assert metric(url, "grpo_actor_reward_mean") == 0.0
    groups = [decode_group(f[b"data"]) for _, f in t.client.xrange(t.keys.groups)]
    assert groups and all(g.rewards == [0.0] * 8 for g in groups)
    assert "grader service" in log.read_text() and "service_http: HTTP 503" in log.read_text()
