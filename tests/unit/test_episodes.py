"""Episodes (env.episodes) over a scripted engine and the real tool environment: the token ids of every turn are
the engine's own, the environment's are appended as it tokenized them, and the mask, log-probs, versions and ends say
who wrote what."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import pytest

from common.config import EnvConfig
from common.rollout import Sample
from env.environment import Response, ToolEnvironment, Turn
from env.episodes import Episodes, episode_counts
from ops.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


class Scripted:
    """A generate function that answers each context with the next scripted turn of its episode, and records every
    call's contexts (an engine's input) and samples (its output)."""

    def __init__(self, turns: dict[int, list[list[int]]], version: int | None = None, stamp: list[int] | None = None):
        self.turns = turns  # episode index -> its model turns' token ids
        self.stamp = stamp  # with it, each call's samples say their tokens came from its version (in flight)
        self.calls: list[tuple[list[list[int]], list[Sample]]] = []
        self.version = version
        self._next: list[int] = []

    def __call__(self, contexts: Sequence[Sequence[int]], n: int, greedy: bool):
        if not self.calls:  # the first turn: n per prompt, episodes numbered prompt-major
            order = list(range(len(contexts) * n))
            self._next = [0] * len(order)
            self._live = order
        else:
            self._live = [e for e in self._live if self._next[e] < len(self.turns[e])]
        out = []
        for e in self._live:
            t = self.turns[e][self._next[e]]
            self._next[e] += 1
            runs = ((self.stamp[len(self.calls)], len(t)),) if self.stamp else ()
            out.append(Sample(t, [-0.5 - 0.01 * i for i in range(len(t))], "stop", runs))
        self.calls.append(([list(c) for c in contexts], out))
        groups = [out[i : i + n] for i in range(0, len(out), n)] if len(self.calls) == 1 else [[s] for s in out]
        return groups, self.version


def test_every_turn_is_the_engines_own_token_for_token(tok):
    eos = tok.eos_token_id
    # The call holds <unk>: decoding and encoding it again would give 5 characters' tokens, so any re-tokenisation
    # of the model's text would show (the tool sees the text without it).
    call = [*ids(tok, "(37*48"), tok.unk_token_id, *ids(tok, ")")]
    engine = Scripted({0: [call, [*ids(tok, "1776"), eos]], 1: [[*ids(tok, "12"), eos]]})
    prompt = [tok.bos_token_id, *ids(tok, "37*48=")]
    env = ToolEnvironment(EnvConfig(name="tool"), tok)
    try:
        (group,), _ = Episodes(env, context_limit=100).run(engine, [prompt], 2)
    finally:
        env.close()
    episode, direct = group
    turn1, turn2 = engine.calls[0][1][0], engine.calls[1][1][0]
    result = ids(tok, "=1776;")
    assert episode.token_ids == turn1.token_ids + result + turn2.token_ids
    assert engine.calls[1][0] == [prompt + turn1.token_ids + result]  # the next turn's context, id for id
    k = len(call)
    assert episode.mask == (1,) * k + (0,) * len(result) + (1,) * 5
    assert episode.logprobs[:k] == turn1.logprobs and episode.logprobs[-5:] == turn2.logprobs
    assert all(math.isnan(x) for x in episode.logprobs[k:-5])
    assert episode.answer_from == k + len(result) and episode.ended == "answer"
    assert direct.token_ids == [*ids(tok, "12"), eos] and direct.mask == () and direct.ended == "answer"
    assert episode_counts(group) == ({"answer": 2}, 1)


def test_the_unknown_token_is_kept_not_retokenised(tok):
    """The model turn with <unk> travels as the engine gave it, whatever the tool made of its text."""
    env = ToolEnvironment(EnvConfig(name="tool", tool="tests.graders_for_tests:tool_hangs_on_x"), tok)
    call = [*ids(tok, "(ab"), tok.unk_token_id, *ids(tok, ")")]
    engine = Scripted({0: [call, [*ids(tok, "ok"), tok.eos_token_id]]})
    try:
        (group,), _ = Episodes(env, context_limit=100).run(engine, [[tok.bos_token_id]], 1)
    finally:
        env.close()
    assert group[0].token_ids[: len(call)] == call
    assert engine.calls[1][0][0][1 : 1 + len(call)] == call


@pytest.mark.parametrize(
    ("tool", "ended"),
    [("tool_hangs_on_x", "tool_timeout"), ("tool_dies_on_x", "tool_crash"), ("tool_hogs_on_x", "tool_memory")],
)
def test_a_failing_tool_ends_its_episode_with_the_reason_and_the_rest_go_on(tok, tool, ended):
    cfg = EnvConfig(name="tool", tool=f"tests.graders_for_tests:{tool}", timeout_s=1.0, memory_mb=512)
    env = ToolEnvironment(cfg, tok)
    eos = tok.eos_token_id
    engine = Scripted({0: [ids(tok, "(x)")], 1: [ids(tok, "(ab)"), [*ids(tok, "ab"), eos]]})
    try:
        (group,), _ = Episodes(env, context_limit=100).run(engine, [[tok.bos_token_id]], 2)
    finally:
        env.close()
    bad, good = group
    assert bad.ended == ended and bad.tool_failed
    assert good.ended == "answer" and not good.tool_failed
    assert good.token_ids == ids(tok, "(ab)") + ids(tok, "=AB;") + ids(tok, "ab") + [eos]


def test_max_turns_and_the_context_limit_end_episodes(tok):
    env = ToolEnvironment(EnvConfig(name="tool", max_turns=2), tok)
    engine = Scripted({0: [ids(tok, "(1+1)"), ids(tok, "(2+2)")], 1: [ids(tok, "(1+1)"), ids(tok, "(3+3)")]})
    try:
        (group,), _ = Episodes(env, context_limit=None).run(engine, [[tok.bos_token_id]], 2)
        assert [s.ended for s in group] == ["max_turns", "max_turns"]
        assert len(engine.calls) == 2  # the second call was never answered
        engine = Scripted({0: [ids(tok, "(1+1)"), [*ids(tok, "2"), tok.eos_token_id]]})
        (group,), _ = Episodes(env, context_limit=7).run(engine, [[tok.bos_token_id]], 1)
        assert group[0].ended == "length" and group[0].finish_reason == "length"
    finally:
        env.close()


def test_versions_join_across_turns_and_environment_tokens_take_the_previous_version(tok):
    class Env:
        stop_ids: ClassVar[set[int]] = set()

        def respond(self, turns: list[Turn]) -> list[Response]:
            return [Response((7, 7)) if t.number == 1 else Response(ended="answer") for t in turns]

        def close(self) -> None: ...

    engine = Scripted({0: [[1, 2], [3]]}, version=None)
    (group,), _ = Episodes(Env(), None).run(engine, [[0]], 1, version_now=lambda: 4)
    # No turn reported versions, and every turn came from one: one run of it (whether the group needs it is the
    # group's to say: tests/unit/test_group_message.py)
    assert group[0].versions == ((4, 5),) and group[0].mask == (1, 1, 0, 0, 1)
    # No turn reported versions, but the turns came from two (whole requests updated in flight: SGLang with a LoRA
    # adapter): each turn's tokens carry its version, or the learner would age the first turn's as the newest
    versions = iter([4, 5])
    engine = Scripted({0: [[1, 2], [3]]}, version=None)
    (group,), _ = Episodes(Env(), None).run(engine, [[0]], 1, version_now=lambda: next(versions))
    assert group[0].versions == ((4, 4), (5, 1)) and group[0].mask == (1, 1, 0, 0, 1)
    # The same when each reply says its version (SGLang's weight_version) rather than the engine being asked
    replies = iter([4, 5])
    scripted = Scripted({0: [[1, 2], [3]]})
    (group,), _ = Episodes(Env(), None).run(lambda c, n, g: (scripted(c, n, g)[0], next(replies)), [[0]], 1)
    assert group[0].versions == ((4, 4), (5, 1))
    # Turns that report them (in-flight updates): joined, the environment's tokens the previous token's version
    engine = Scripted({0: [[1, 2], [3]]}, stamp=[4, 5])
    (group,), _ = Episodes(Env(), None).run(engine, [[0]], 1)
    assert group[0].versions == ((4, 4), (5, 1))


def test_a_call_close_of_several_tokens_is_a_config_error(tok):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match=r"env\.call_close"):
        ToolEnvironment(EnvConfig(name="tool", call_close="))"), tok)


def test_the_calculator_is_arithmetic_only():
    from env.calculator import calculator

    assert calculator("37*48") == "1776" and calculator("(1+2)*3") == "9" and calculator("7/7") == "1"
    for bad in ("__import__('os')", "2**1000", "x", "1/0", "", "1e308*1e308"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_a_grader_past_its_memory_limit_scores_0_counted_and_the_pool_goes_on():
    from grader.pool import GraderPool

    with GraderPool("tests.graders_for_tests:hog_on_x", 5.0, "process", memory_mb=512) as pool:
        result = pool.grade([("8", "8"), ("x", "8"), ("8", "8")])
    assert result.scores == [1.0, 0.0, 1.0] and result.errors == {"memory": 1}
