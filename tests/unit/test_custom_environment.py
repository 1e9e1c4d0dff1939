"""Your own environment chosen from the config (env.custom): built from ``env.name`` and ``env.args``, told what each
prompt asks, held to ``env.max_turns``, and its failures ending episodes with a counted reason, never the actor."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from common.config import ConfigError, EnvConfig
from common.tasks import Problem
from env.environment import Response, Turn
from env.episodes import Episodes, episode_counts, make_environment
from ops.tiny_model import build_tokenizer
from tests.unit.test_episodes import Scripted

TRY_AGAIN = "examples.environments.try_again:TryAgain"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def user_module() -> Iterator[types.ModuleType]:
    """A module ``user_envs`` importable by name, as a user's installed package is, holding the classes under test."""
    module = types.ModuleType("user_envs")
    sys.modules["user_envs"] = module
    yield module
    del sys.modules["user_envs"]


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_the_example_is_built_with_its_args_and_told_each_prompts_problem(tok):
    env = make_environment(EnvConfig(name=TRY_AGAIN, args={"feedback": "no:"}, max_turns=3), tok)
    assert env is not None
    eos = tok.eos_token_id
    # Episode 0 answers 8 at once; episode 1 says 7, is told "no:", says 9, is told again, says 8 (its third turn).
    engine = Scripted({0: [[*ids(tok, "8"), eos]], 1: [[*ids(tok, "7"), eos], [*ids(tok, "9"), eos], ids(tok, "8")]})
    try:
        (group,), _ = Episodes(env, None, 3).run(engine, [ids(tok, "3+5=")], 2, problems=[Problem("p", "3+5=", "8")])
    finally:
        env.close()
    assert [s.ended for s in group] == ["answer", "answer"]
    assert group[0].mask == () and tok.decode(group[1].token_ids) == "7<eos>no:9<eos>no:8"
    assert group[1].mask == (1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1)  # the feedback is the environment's, never trained


def test_one_bad_reply_ends_its_own_episode_and_not_its_neighbours(tok, user_module):
    class OneTooLong:
        stop_ids: ClassVar[set[int]] = set()

        def __init__(self, tokenizer: Any):
            pass

        def respond(self, turns: list[Turn]) -> list[Response]:
            return [Response((7,) * (9 if i == 0 else 1)) if t.number == 1 else Response(ended="answer")
                    for i, t in enumerate(turns)]  # fmt: skip

        def close(self) -> None: ...

    user_module.OneTooLong = OneTooLong
    env = make_environment(EnvConfig(name="user_envs:OneTooLong", max_response_tokens=8), tok)
    assert env is not None
    (group,), _ = Episodes(env, None, 3).run(Scripted({0: [[5]], 1: [[6], [4]]}), [[0]], 2)
    assert [s.ended for s in group] == ["tool_invalid", "answer"] and group[1].token_ids == [6, 7, 4]


def test_ids_of_any_integer_type_are_taken_as_ints(tok, user_module):
    np = pytest.importorskip("numpy")

    class NumpyIds:
        stop_ids: ClassVar[set[int]] = set()

        def __init__(self, tokenizer: Any):
            pass

        def respond(self, turns: list[Turn]) -> list[Response]:
            return [Response(tuple(np.array([7, 8]))) if t.number == 1 else Response(ended="answer") for t in turns]

        def close(self) -> None: ...

    user_module.NumpyIds = NumpyIds
    env = make_environment(EnvConfig(name="user_envs:NumpyIds"), tok)
    assert env is not None
    (group,), _ = Episodes(env, None, 3).run(Scripted({0: [[5], [6]]}), [[0]], 1)
    assert group[0].ended == "answer" and group[0].token_ids == [5, 7, 8, 6]
    assert all(type(t) is int for t in group[0].token_ids)


def test_an_environment_that_would_go_on_past_max_turns_ends_the_episode(tok):
    env = make_environment(EnvConfig(name=TRY_AGAIN, max_turns=2), tok)
    assert env is not None
    engine = Scripted({0: [ids(tok, "1"), ids(tok, "2"), ids(tok, "3")]})
    (group,), _ = Episodes(env, None, 2).run(engine, [[0]], 1, problems=[Problem("p", "3+5=", "8")])
    assert group[0].ended == "max_turns" and len(engine.calls) == 2  # its third turn is never generated


def test_a_failing_environment_ends_its_episodes_counted_and_logs_the_reason_once(tok, user_module, caplog):
    class Raises:
        stop_ids: ClassVar[set[int]] = set()

        def __init__(self, tokenizer: Any):
            pass

        def respond(self, turns: list[Turn]) -> list[Response]:
            raise RuntimeError("the board is on fire")

        def close(self) -> None: ...

    class Invalid(Raises):
        def __init__(self, tokenizer: Any, reply: Any):
            self.reply = reply

        def respond(self, turns: list[Turn]) -> Any:
            return self.reply(turns)

    user_module.Raises, user_module.Invalid = Raises, Invalid
    cases = {
        "tool_exception": ("Raises", {}),
        "tool_invalid": ("Invalid", {"reply": lambda turns: []}),  # one response short
    }
    bad_replies = [
        lambda turns: ["text" for _ in turns],  # not Responses
        lambda turns: [Response(None) for _ in turns],  # type: ignore[arg-type]  # no token ids at all
        lambda turns: [Response(b"no") for _ in turns],  # type: ignore[arg-type]  # text.encode(), not ids
        lambda turns: [Response((True, 5)) for _ in turns],  # a bool is not an id
        lambda turns: [Response((5.0,)) for _ in turns],  # nor a float
        lambda turns: [Response(tuple(range(9))) for _ in turns],  # over env.max_response_tokens
        lambda turns: [Response((len(tok),)) for _ in turns],  # an id past the tokenizer's
        lambda turns: [Response(ended="solved") for _ in turns],  # not an EpisodeEnd
    ]
    runs = [*cases.values(), *(("Invalid", {"reply": r}) for r in bad_replies)]
    ends = [*cases, *["tool_invalid"] * len(bad_replies)]
    for (cls, args), end in zip(runs, ends, strict=True):
        env = make_environment(EnvConfig(name=f"user_envs:{cls}", args=args, max_response_tokens=8), tok)
        assert env is not None
        with caplog.at_level(logging.WARNING, logger="env.custom"):
            caplog.clear()
            for _ in range(2):
                (group,), _ = Episodes(env, None, 3).run(Scripted({0: [[5]], 1: [[6]]}), [[0]], 2)
                assert [s.ended for s in group] == [end, end] and all(s.tool_failed for s in group)
        assert episode_counts(group)[0] == {end: 2}
        assert len(caplog.records) == 1 and end in caplog.text, caplog.text  # once per kind, with its reason


@pytest.mark.parametrize(
    ("name", "args", "field", "says"),
    [
        ("no_such_module_here:Env", {}, "env.name", "cannot be imported"),
        ("examples.environments.try_again:Missing", {}, "env.name", "cannot be imported"),
        (TRY_AGAIN, {"colour": "red"}, "env.args", "colour"),
        ("user_envs:NotAnEnv", {}, "env.name", "no stop_ids, respond"),
    ],
)
def test_a_class_that_cannot_be_imported_or_built_is_a_config_error_naming_the_field(
    tok, user_module, name, args, field, says
):
    user_module.NotAnEnv = lambda tokenizer: object()
    with pytest.raises(ConfigError, match=rf"^config error: {field}: .*{says}"):
        make_environment(EnvConfig(name=name, args=args), tok)


def test_env_name_takes_a_class_path_and_refuses_anything_else():
    assert EnvConfig(name="my.pkg:MyEnv").name == "my.pkg:MyEnv"
    for bad in ("my.pkg", "my.pkg:My Env", "tools"):
        with pytest.raises(ValueError, match="name"):
            EnvConfig(name=bad)
    # The message size is reckoned from the environment's turns: env.max_response_tokens for your class
    assert EnvConfig(name="my.pkg:MyEnv", max_turns=3, max_response_tokens=10).max_episode_tokens(5) == 3 * 5 + 2 * 10
