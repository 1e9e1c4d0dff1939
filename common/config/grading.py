"""The config tree's sections on how an answer is scored, shared by both roles (the actors reward with them, the
learner evaluates with them): ``grader`` (a built-in or your own function, combined ones, a scoring service),
``shaping`` (the overlong penalty) and ``env`` (multi-turn episodes with a tool). The other shared sections are in
:mod:`common.config.shared`."""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from common import grader_names
from common.config.shared import Section

_GRADERS = "|".join((*grader_names.BUILTIN, grader_names.CUSTOM))


_SERVICE_ONLY = ("url", "batch_size", "retries", "retry_backoff_s", "round_budget_s")


def _answer_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot be a regex grader's (it needs exactly one group: the answer), or None."""
    try:
        groups = re.compile(pattern).groups
    except re.error as e:
        return f"not a regular expression: {e}"
    return None if groups == 1 else f"regex needs exactly one group (the answer), it has {groups}"


def _service_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a scoring service's endpoint, or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError as e:
        return f"{url!r} is not a URL: {e}"
    if parts.scheme.lower() not in ("http", "https"):
        return f"{url!r}: the scheme must be http or https"
    if not parts.hostname:
        return f"{url!r} names no host"
    return None


class GraderComponent(Section):
    name: str = Field(..., pattern=f"^({_GRADERS})$", description="a grader, as grader.name (not combine)")
    weight: float = Field(1.0, gt=0, description="its weight in the mean")
    pattern: str = Field("", description="its pattern, for regex and format")


class GraderConfig(Section):
    name: str = Field(
        "addition",
        pattern=f"^({_GRADERS}|{grader_names.COMBINE}|{grader_names.SERVICE})$",
        description=f"a built-in grader ({', '.join((*grader_names.BUILTIN, grader_names.COMBINE))}), service (an "
        "HTTP scorer at grader.url) or your own as module.path:function",
    )
    pattern: str = Field(
        "",
        description="regex: a regular expression whose one group is the answer (its last match is compared with "
        "the reference); format: the layout the whole completion must have (empty = think, then answer tags)",
    )
    components: list[GraderComponent] = Field(
        default_factory=list,
        description="combine: the graders whose weighted mean is the reward, e.g. [{name: gsm8k, weight: 0.9}, "
        "{name: format, weight: 0.1}]",
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        description="time limit per answer; past it the answer scores 0 (service: per attempt at a request, "
        "everything included: name lookup, connecting, sending, the whole answer)",
    )
    isolation: Literal["process", "inline"] = Field(
        "process",
        description="process: graders run in a worker process that is killed on a time-out (service: not used)",
    )
    memory_mb: int = Field(
        0,
        ge=0,
        description="isolation process: address-space limit of the grader's worker in MiB (0 = none); an answer "
        "whose grading needs more scores 0, counted as memory (or crash, when the worker dies of it)",
    )
    url: str = Field(
        "",
        description="service: the scorer's http:// or https:// endpoint; POSTed {items: [{prompt, completion, "
        "reference}]}, it answers {scores: [...]} in [0, 1] (docs/tasks.md: Rewards from a service)",
    )
    batch_size: int = Field(16, ge=1, description="service: answers per request")
    retries: int = Field(
        2,
        ge=0,
        description="service: attempts after the first on a time-out, a refused or lost connection, or HTTP 5xx or "
        "429 (another 4xx is not retried); past them every answer of the batch scores 0 and is counted",
    )
    retry_backoff_s: float = Field(
        0.5, ge=0, description="service: the wait before the first retry, doubled before each next one"
    )
    round_budget_s: float = Field(
        0.0,
        ge=0,
        description="service: the seconds a round's batches (one engine call's answers, or one evaluation batch) "
        "may take in all, retries and backoffs included, so the most an actor waits for its scores per round; the "
        "request in flight at the end is cut (service_timeout), the batches not sent score 0 (service_budget). 0 = "
        "(batches + retries) x timeout_s + one batch's backoffs: every batch's first attempt and one batch's "
        "retries, which a scorer answering each batch within timeout_s never reaches",
    )

    @model_validator(mode="after")
    def _check_options(self) -> GraderConfig:
        if self.name == grader_names.COMBINE and not self.components:
            raise ValueError("grader.components: combine needs at least one component")
        if self.components and self.name != grader_names.COMBINE:
            raise ValueError("grader.components: only used with grader.name=combine")
        regexes = [("grader.pattern", self.pattern)] if self.name == "regex" else []
        regexes += [
            (f"grader.components.{i}.pattern", c.pattern) for i, c in enumerate(self.components) if c.name == "regex"
        ]
        for where, pattern in regexes:
            if problem := _answer_pattern_problem(pattern):
                raise ValueError(f"{where}: {problem}")
        return self

    @model_validator(mode="after")
    def _check_service(self) -> GraderConfig:
        if self.name != grader_names.SERVICE:
            # Compared with the defaults, not with the keys given: a resolved config.json read back sets them all.
            for key in _SERVICE_ONLY:
                if getattr(self, key) != GraderConfig.model_fields[key].default:
                    raise ValueError(f"grader.{key}: only used with grader.name=service")
            return self
        if not self.url:
            raise ValueError("grader.url: grader.name=service needs the scorer's URL (http:// or https://)")
        if problem := _service_url_problem(self.url):
            raise ValueError(f"grader.url: {problem}")
        return self

    def spec(self) -> str | dict[str, Any]:
        """What grader.build_grader takes: the name alone, or the name with its options."""
        if self.name in (*grader_names.WITH_PATTERN, grader_names.COMBINE):
            return {"name": self.name, "pattern": self.pattern, "components": [c.model_dump() for c in self.components]}
        return self.name


class ShapingConfig(Section):
    overlong_cache: int = Field(
        0,
        ge=0,
        description="DAPO soft overlong punishment: the last this many tokens before sampling.max_new_tokens are "
        "penalised linearly down to -overlong_factor; 0 = off. Computed by the actors (their zero-std filter "
        "decides on it) and sent with each group for the learner's advantages",
    )
    overlong_factor: float = Field(1.0, ge=0, description="the overlong penalty at max_new_tokens (DAPO: 1)")

    def enabled(self) -> bool:
        return self.overlong_cache > 0 and self.overlong_factor > 0


class EnvConfig(Section):
    # What an episode is and how the tool runs: env/environment.py's docstring; your own class: env/custom.py's.
    name: str = Field(
        "single_turn",
        pattern=r"^(single_turn|tool|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
        description="single_turn: one answer per prompt, graded (no environment); tool: episodes of model turns and "
        "tool results, the model calling env.tool by writing env.call_open ... env.call_close; module.path:Class: "
        "your own Environment (docs/episodes.md), built as Class(tokenizer, **env.args) in every process that samples",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="module.path:Class: the keyword arguments its constructor takes (a mapping; -o env.args.KEY=VALUE "
        "reads VALUE as YAML: quote text that YAML reads otherwise, as -o 'env.args.feedback=\" no:\"')",
    )
    max_response_tokens: int = Field(
        64,
        ge=1,
        description="module.path:Class: an environment turn's tokens at most; a longer one ends its episode, scored 0 "
        "(tool_invalid)",
    )
    tool: str = Field(
        "calculator",
        pattern=r"^(calculator|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
        description="tool: the built-in calculator (arithmetic on numbers: + - * / // % ** and parentheses) or your "
        "own as module.path:function, taking the call's text and returning the result's text",
    )
    max_turns: int = Field(
        3,
        ge=1,
        description="tool and your class: model turns per episode at most; the last one ends it unanswered (max_turns)",
    )
    call_open: str = Field("(", min_length=1, description="tool: the text that opens a call in a model turn")
    call_close: str = Field(
        ")",
        min_length=1,
        description="tool: the text that closes a call; it must be one token of the model's tokenizer (a model turn "
        "stops there, as at end-of-sequence)",
    )
    result_template: str = Field(
        "={result};",
        description="tool: the text appended after a call, {result} the tool's answer; tokenized on its own, the "
        "model's tokens are never re-tokenized",
    )
    max_result_chars: int = Field(64, ge=1, description="tool: a longer result is cut to this many characters")
    timeout_s: float = Field(5.0, gt=0, description="tool: time limit per call; past it the episode ends, scored 0")
    memory_mb: int = Field(
        512,
        ge=0,
        description="tool: address-space limit of the tool's worker process in MiB (0 = none); a call that needs "
        "more ends its episode, scored 0, and the worker is restarted",
    )

    @model_validator(mode="after")
    def _check_args(self) -> EnvConfig:
        if self.args and self.name in ("single_turn", "tool"):
            raise ValueError(f"env.args: used by your own class (env.name: module.path:Class) only, not {self.name}")
        return self

    def max_episode_tokens(self, max_new_tokens: int) -> int:
        """The most tokens one episode's completion can hold: every turn at ``sampling.max_new_tokens`` and, between
        them, results of ``max_result_chars`` (a character is at most a token here, as in every tokenizer's worst
        case of one character a token; the template's own text added) or, from your class, ``max_response_tokens``."""
        if self.name == "single_turn":
            return max_new_tokens
        between = self.max_result_chars + len(self.result_template) if self.name == "tool" else self.max_response_tokens
        return self.max_turns * max_new_tokens + (self.max_turns - 1) * between
