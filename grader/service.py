"""Rewards from a scoring service: ``grader.name: service`` sends the answers to an HTTP endpoint (a judge model, or
any scorer you run) and takes its scores as rewards.

The contract a scorer implements
--------------------------------
Request: ``POST <grader.url>`` with ``Content-Type: application/json`` and at most ``grader.batch_size`` items::

    {"items": [{"prompt": "What is 3+4?", "completion": "It is 7.", "reference": "7"}, ...]}

``prompt`` is the problem's prompt as the task wrote it (``null`` where the caller passes none), ``completion`` the
answer's text without its stop token (:func:`common.rollout.sample_texts`), ``reference`` the problem's answer.

Response: status 2xx with a JSON object holding one score per item, in item order, each a number in [0, 1] (other
keys are ignored)::

    {"scores": [1.0, 0.0, ...]}

What a failure costs
--------------------
Each attempt has ``grader.timeout_s`` in all, from looking the host's name up to the answer's last byte, whatever
the server does (one that sends its status line, headers or body a byte at a time is cut at the deadline as one
that never answers is: :mod:`grader.timed_http`). A time-out, a refused or lost connection, HTTP 5xx and 429 are
tried again, up to ``grader.retries`` more times, after ``grader.retry_backoff_s`` doubling each time; another 4xx
(the request itself is wrong) and an answer that breaks the contract are not. When a batch still has no scores,
every answer in it scores 0 and is counted by kind (the label of ``grpo_actor_grader_errors_total``):
``service_timeout``, ``service_unreachable``, ``service_http`` (a status other than 2xx), ``service_invalid`` (not
JSON, no ``scores`` list, a list of the wrong length, not HTTP at all). One score that is not a number in [0, 1]
scores 0 alone and counts as ``invalid``, as a grader's would. The other batches are sent regardless: a failing
scorer costs rewards, never the actor.

A round (one ``grade`` call: an actor's round, an evaluation batch) has ``grader.round_budget_s`` for all its
batches, retries and backoffs included. 0 (the default) gives it every batch's first attempt and one batch's
retries, ``(batches + retries) × timeout_s`` plus the backoffs of ``retries`` retries: a scorer that answers each
batch within its time-out never reaches it, and a round of one batch has all its attempts. The attempt in flight at
the round's deadline is cut there (``service_timeout``), a retry whose backoff would end past it is not made (the
batch keeps its failure's kind), and the batches not yet sent score 0, counted as ``service_budget``. So a round
never takes longer than its budget (give or take a few milliseconds), whatever the scorer and the name service do:
that is the most an actor waits for its scores per round.

Batches go one at a time over a fresh connection each, with the standard library alone (no proxy is used). With
``require_stop`` an answer cut off at the length limit scores 0 whatever the scorer would say, so it is not sent.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from common.rollout import GraderErrorKind, GradeResult, Sample, sample_texts, unjudged_zeros
from grader.protocol import check_score
from grader.timed_http import Resolver, post

log = logging.getLogger(__name__)

Scored = tuple[float, GraderErrorKind | None]  # an answer's reward, and why it is 0 when grading failed


@dataclass
class ServiceFailure(Exception):
    """An attempt that got no scores: the kind it is counted as, what happened, and whether to try again."""

    kind: GraderErrorKind
    detail: str
    retry: bool

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def request_body(prompts: list[str | None], completions: list[str], references: list[str]) -> bytes:
    items = [
        {"prompt": p, "completion": c, "reference": r} for p, c, r in zip(prompts, completions, references, strict=True)
    ]
    return json.dumps({"items": items}, ensure_ascii=False).encode()


def parse_scores(answer: bytes, n: int) -> list[Scored]:
    """The rewards in a 2xx answer to ``n`` items; one that is not a number in [0, 1] is ``(0.0, "invalid")``.
    Raises :class:`ServiceFailure` (``service_invalid``, not retried) when the answer as a whole breaks the contract."""
    try:
        doc = json.loads(answer)
    except ValueError as e:  # UnicodeDecodeError included
        raise ServiceFailure("service_invalid", f"the answer is not JSON ({e})", retry=False) from None
    scores = doc.get("scores") if isinstance(doc, dict) else None
    if not isinstance(scores, list):
        raise ServiceFailure("service_invalid", 'the answer is not an object with a "scores" list', retry=False)
    if len(scores) != n:
        raise ServiceFailure("service_invalid", f"{len(scores)} scores for {n} items", retry=False)
    out: list[Scored] = []
    for value in scores:
        try:
            out.append((check_score(value), None))
        except ValueError:
            out.append((0.0, "invalid"))
    return out


def status_failure(status: int, answer: bytes) -> ServiceFailure | None:
    """None for a 2xx status; otherwise the failure, retried for 5xx and 429 (the scorer is busy or broken for now)
    and not for any other status (a 4xx says the request is wrong: sending it again will not change that)."""
    if 200 <= status < 300:
        return None
    said = answer[:200].decode("utf-8", "replace").strip()
    return ServiceFailure("service_http", f"HTTP {status} {said!r}", retry=status == 429 or status >= 500)


def exception_failure(e: Exception, timeout_s: float) -> ServiceFailure:
    """The failure an attempt that raised counts as. TimeoutError is an OSError and IncompleteRead an HTTPException,
    hence the order."""
    if isinstance(e, TimeoutError):
        return ServiceFailure("service_timeout", f"no whole answer within {timeout_s:.3g}s", retry=True)
    if isinstance(e, (OSError, http.client.IncompleteRead)):  # refused, reset, lost mid-answer, no route, DNS, TLS
        return ServiceFailure("service_unreachable", f"{type(e).__name__}: {e}", retry=True)
    if isinstance(e, http.client.HTTPException):  # something answered, but not in HTTP
        return ServiceFailure("service_invalid", f"not an HTTP answer ({type(e).__name__}: {e})", retry=False)
    raise e


class ServiceGrader:
    """Grades through a scoring service (see the module docstring): a :class:`common.rollout.SampleGrader`, as the
    worker pool is, so a role takes either from :func:`grader.open.open_grader`. It holds no connection or process
    between calls."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        batch_size: int = 16,
        retries: int = 2,
        retry_backoff_s: float = 0.5,
        round_budget_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.name = "service"
        self.url = url
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.round_budget_s = round_budget_s
        self._sleep = sleep
        self._resolver = Resolver()
        parts = urlsplit(url)
        # For logs: no credentials or query (an API key may travel in either).
        self.where = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path}"

    def grade(self, pairs: list[tuple[str, str]], prompts: Sequence[str | None] | None = None) -> GradeResult:
        """Scores of (completion, reference) pairs, ``prompts`` sent beside them (``null`` where None)."""
        asked: list[str | None] = list(prompts) if prompts is not None else [None] * len(pairs)
        if len(asked) != len(pairs):
            raise ValueError(f"{len(asked)} prompts for {len(pairs)} answers")
        result = GradeResult([0.0] * len(pairs))
        starts = range(0, len(pairs), self.batch_size)
        budget_s = self.round_budget(len(starts))
        deadline = time.monotonic() + budget_s
        for start in starts:
            if time.monotonic() >= deadline:
                log.warning("grader service %s: the round's budget of %.3gs is spent; %d answers not sent score 0 "
                            "(service_budget)", self.where, budget_s, len(pairs) - start)  # fmt: skip
                for i in range(start, len(pairs)):
                    result.put(i, 0.0, "service_budget")
                break
            batch = pairs[start : start + self.batch_size]
            body = request_body(asked[start : start + len(batch)], [c for c, _ in batch], [r for _, r in batch])
            for i, (score, kind) in enumerate(self._score_batch(body, len(batch), deadline), start):
                result.put(i, score, kind)
        return result

    def round_budget(self, batches: int) -> float:
        """The seconds a round of ``batches`` may take: ``round_budget_s``, or by default each batch's first attempt
        and one batch's retries with their backoffs (one batch alone has all its attempts, as without a budget)."""
        if self.round_budget_s > 0:
            return self.round_budget_s
        return (batches + self.retries) * self.timeout_s + self.retry_backoff_s * (2**self.retries - 1)

    def _score_batch(self, body: bytes, n: int, deadline: float) -> list[Scored]:
        """One batch's rewards, tried up to ``1 + retries`` times while the round's ``deadline`` leaves time; all
        ``(0.0, kind)`` when no attempt got them."""
        attempts = 1 + self.retries
        for attempt in range(1, attempts + 1):
            try:
                return self._attempt(body, n, deadline)
            except ServiceFailure as failure:
                wait = self.retry_backoff_s * 2 ** (attempt - 1)
                last = not failure.retry or attempt == attempts
                spent = not last and time.monotonic() + wait >= deadline  # the retry would start past the budget
                if last or spent:
                    log.warning("grader service %s: %s (attempt %d/%d%s); %d answers score 0", self.where, failure,
                                attempt, attempts, ", the round's budget spent" if spent else "", n)  # fmt: skip
                    return [(0.0, failure.kind)] * n
                log.info("grader service %s: %s (attempt %d/%d); again in %.2gs",
                         self.where, failure, attempt, attempts, wait)  # fmt: skip
                self._sleep(wait)
        raise AssertionError("the last attempt returns")

    def _attempt(self, body: bytes, n: int, round_deadline: float) -> list[Scored]:
        """One attempt, within ``grader.timeout_s`` and what is left of the round."""
        started = time.monotonic()
        deadline = min(started + self.timeout_s, round_deadline)
        try:
            status, answer = post(self.url, body, deadline, self._resolver)
        except Exception as e:
            raise exception_failure(e, deadline - started) from None
        if failure := status_failure(status, answer):
            raise failure
        return parse_scores(answer, n)

    def grade_samples(
        self,
        tokenizer: Any,
        samples: Sequence[Sample],
        references: Sequence[str],
        *,
        require_stop: bool,
        prompts: Sequence[str] | None = None,
    ) -> GradeResult:
        """common.rollout.SampleGrader's; with ``require_stop`` only the answers that stopped are sent (the others
        score 0 whatever the scorer says, and a judge's time is the dear part)."""
        if len(references) != len(samples) or (prompts is not None and len(prompts) != len(samples)):
            raise ValueError(f"{len(samples)} samples, {len(references)} references, prompts: {prompts is not None}")
        texts = sample_texts(tokenizer, samples)
        asked: Sequence[str | None] = prompts if prompts is not None else [None] * len(samples)
        sent = [i for i, s in enumerate(samples) if not require_stop or s.finish_reason == "stop"]
        graded = self.grade([(texts[i], references[i]) for i in sent], [asked[i] for i in sent])
        result = GradeResult([0.0] * len(samples), graded.errors)
        for i, score in zip(sent, graded.scores, strict=True):
            result.scores[i] = score
        return unjudged_zeros(samples, result, require_stop=require_stop)

    def close(self) -> None:
        """Nothing to release: every request has its own connection."""

    def __enter__(self) -> ServiceGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
