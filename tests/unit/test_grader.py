"""grader: the built-in reward functions, and the pool's time limit and error counting."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from common.rollout import Sample
from grader import GRADERS, build_grader, get_grader
from grader.builtin import gsm8k, gsm8k_final_answer, normalise_number
from grader.pool import GraderPool


@pytest.mark.parametrize(
    ("completion", "reference", "score"),
    [("8", "8", 1.0), ("08", "8", 0.0), (" 8", "8", 0.0), ("8 ", "8", 0.0), ("18", "8", 0.0), ("", "0", 0.0)],
)
def test_addition_is_exact(completion: str, reference: str, score: float) -> None:
    assert get_grader("addition")(completion, reference) == score


def test_exact_strips_whitespace() -> None:
    assert get_grader("exact")("  Paris\n", "Paris") == 1.0
    assert get_grader("exact")("paris", "Paris") == 0.0


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("She pays 3 + 4 = 7 dollars.\n#### 1,234", 1.0),
        ("so \\boxed{1234} is it", 1.0),
        ("The answer is $1,234.00.", 1.0),
        ("I think 12 then 1234", 1.0),  # the last number when there is no marker
        ("#### 1234 but then 99", 1.0),  # a marker beats a later bare number
        ("#### 1234 ... \\boxed{7}", 1.0),  # "####" before \boxed before "the answer is"
        ("the answer is 7. #### 1,234", 1.0),
        ("It costs €1,234.", 1.0),
        ("I get £1,234.00", 1.0),
        ("The answer is 1233", 0.0),
        ("no numbers here", 0.0),
        ("9" * 200_000, 0.0),  # a megabyte-scale number is not a hang
    ],
)
def test_gsm8k(completion: str, score: float) -> None:
    assert get_grader("gsm8k")(completion, "Natalia sold 48 ... \n#### 1234") == score


def test_gsm8k_number_normalisation() -> None:
    assert normalise_number("$1,234.00") == normalise_number("1234")
    assert normalise_number("-3.50") == normalise_number("-3.5")
    assert normalise_number("abc") is None
    assert gsm8k_final_answer("x = 5, y = 7") == normalise_number("7")


@pytest.mark.parametrize(
    ("completion", "reference", "score"),
    [
        ("$\\frac{1}{2}$", "0.5", 1.0),
        ("The result is $x^2+2x$", "2x + x^2", 1.0),
        ("$3$", "4", 0.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),  # LaTeX fraction against a decimal
        ("The answer is $\\frac{6}{8}$", "\\frac{3}{4}", 1.0),  # unreduced against reduced
        ("$\\sqrt{4}$", "2", 1.0),
        ("$(1, 2]$", "(1,2]", 1.0),  # intervals
        ("$50\\%$", "0.5", 1.0),
        ("$x = 3$", "3", 1.0),  # an equation's right-hand side
        ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),  # close is not equal
    ],
)
def test_math_verify(completion: str, reference: str, score: float) -> None:
    assert get_grader("math")(completion, reference) == score


def test_registry_knows_builtins_and_import_paths() -> None:
    assert {"addition", "exact", "gsm8k", "math"} <= set(GRADERS)
    assert get_grader("tests.graders_for_tests:out_of_range")("8", "8") == 1.0
    with pytest.raises(KeyError, match="unknown grader"):
        get_grader("nope")
    with pytest.raises(KeyError, match="cannot be imported"):
        get_grader("no.such.module:fn")


@pytest.mark.parametrize(
    ("grader", "kind"),
    [
        ("tests.graders_for_tests:hang_on_x", "timeout"),
        ("tests.graders_for_tests:boom_on_x", "exception"),
        ("tests.graders_for_tests:die_on_x", "crash"),
        ("tests.graders_for_tests:out_of_range", "invalid"),
    ],
)
def test_a_bad_answer_scores_zero_is_counted_and_the_rest_are_graded(grader: str, kind: str) -> None:
    pairs = [("8", "8"), ("x", "8"), ("7", "7"), ("1", "2"), ("x", "8"), ("5", "5")]
    t0 = time.monotonic()
    with GraderPool(grader, timeout_s=1.0) as pool:
        result = pool.grade(pairs)
        again = pool.grade([("3", "3")])  # the pool still works afterwards
    assert result.scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert result.errors == {kind: 2}
    assert again.scores == [1.0]
    assert time.monotonic() - t0 < 30  # two 1 s time-outs plus restarts, not an hour


def test_inline_pool_counts_exceptions_too() -> None:
    with GraderPool("tests.graders_for_tests:boom_on_x", isolation="inline") as pool:
        result = pool.grade([("x", "8"), ("8", "8")])
    assert result.scores == [0.0, 1.0] and result.errors == {"exception": 1}


def test_a_grader_that_prints_does_not_corrupt_the_pipe() -> None:
    with GraderPool("tests.graders_for_tests:prints") as pool:
        assert pool.grade([("8", "8"), ("9", "8")]).scores == [1.0, 0.0]


def test_a_grader_worker_loads_no_torch() -> None:
    # Checked inside the real worker process: the probe grader looks at its own process's sys.modules.
    probe = "tests.graders_for_tests:no_heavy_modules"
    with GraderPool({"name": "combine", "components": [{"name": "math"}, {"name": probe}]}) as pool:
        assert pool.grade([("1", "1")]).scores == [1.0]  # math scored 1 and so did the probe: nothing heavy loaded


def test_a_first_answer_is_not_charged_for_the_graders_imports() -> None:
    # The probe's first call takes 3 s (as an import would); the worker makes it before the first answer's clock.
    with GraderPool("tests.graders_for_tests:slow_first_call", timeout_s=1.0) as pool:
        result = pool.grade([("8", "8")])
    assert result.scores == [1.0] and not result.errors


def test_math_grades_a_first_answer_within_a_tight_limit() -> None:
    # math-verify's import (sympy) takes most of a second; an answer's grading takes milliseconds.
    with GraderPool("math", timeout_s=0.3) as pool:
        result = pool.grade([("\\frac{1}{2}", "0.5")])
    assert result.scores == [1.0] and not result.errors


@pytest.mark.parametrize("grader", ["math", "gsm8k", "addition", "exact"])
def test_pathological_answers_finish_within_the_limit_and_score_0(grader: str) -> None:
    nasty = [
        "(" * 5000 + "1" + ")" * 5000,  # deep nesting
        "2^{2^{2^{2^{2^{99999}}}}}",  # an enormous number
        "\\frac{" * 300 + "1" + "}" * 300,  # deeply nested LaTeX
        "9" * 10**6,  # a million digits
        "the answer is " * 80_000,  # a megabyte of text
        "\\boxed{" * 2000 + "}" * 2000 + " #### " * 1000,  # markers that never close on a number
    ]
    t0 = time.monotonic()
    with GraderPool(grader, timeout_s=5.0) as pool:
        result = pool.grade([(n, "7") for n in nasty])  # wrong answers all: each must score 0, in time
    assert result.scores == [0.0] * len(nasty)
    assert time.monotonic() - t0 < 5.0 * len(nasty) + 60


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("0") + i) if i < 10 else "<pad>" for i in ids)


def test_grade_samples_requires_a_stop_and_sees_no_stop_token() -> None:
    eos = 11
    samples = [
        Sample([8, eos], [-0.1, -0.1], "stop"),
        Sample([8], [-0.1], "length"),
        Sample([8, 10, eos], [-1] * 3, "stop"),
    ]
    with GraderPool("addition", isolation="inline") as pool:
        strict = pool.grade_samples(_Tok(), samples, ["8", "8", "8"], require_stop=True)
        lax = pool.grade_samples(_Tok(), samples, ["8", "8", "8"], require_stop=False)
    assert strict.scores == [1.0, 0.0, 0.0]  # cut off; and "8<pad>" is not "8"
    assert lax.scores == [1.0, 1.0, 0.0]


def test_regex_grader_compares_the_last_match_with_the_reference() -> None:
    from grader import build_grader

    g = build_grader({"name": "regex", "pattern": r"Answer:\s*(\S+)"})
    assert g("Answer: 12 ... wait. Answer: 14", "14") == 1.0  # the last match counts
    assert g("Answer: 12", "14") == 0.0 and g("no answer line", "14") == 0.0
    with pytest.raises(KeyError, match="exactly one group"):
        build_grader({"name": "regex", "pattern": r"\d+"})


def test_format_grader_checks_the_whole_layout() -> None:
    from grader import build_grader

    g = build_grader({"name": "format", "pattern": ""})
    assert g("<think>3 apples and 4</think>\n<answer>7</answer>", "7") == 1.0
    assert g("<think>multi\nline</think><answer>x</answer>\n", "") == 1.0
    assert g("7", "7") == 0.0 and g("<answer>7</answer>", "7") == 0.0
    assert g("<think>a</think><answer>7</answer> and more", "7") == 0.0


def test_weighted_combination_through_the_process_pool() -> None:
    """A spec with options reaches the worker process as JSON and is rebuilt there."""
    spec = {"name": "combine", "components": [{"name": "gsm8k", "weight": 0.9}, {"name": "format", "weight": 0.1}]}
    with GraderPool(spec, timeout_s=5.0) as pool:
        result = pool.grade([
            ("<think>3+4</think><answer>#### 7</answer>", "#### 7"),
            ("#### 7", "#### 7"),
            ("<think>3+4</think><answer>8</answer>", "#### 7"),
            ("9", "#### 7"),
        ])  # fmt: skip
    assert result.scores == pytest.approx([1.0, 0.9, 0.1, 0.0]) and not result.errors


def test_grader_options_are_checked_in_the_config() -> None:
    from common.config import ConfigError, load_config

    cfg = load_config(overrides=["grader.name=combine", "grader.components=[{name: gsm8k, weight: 3}, {name: format}]"],
                      env={})  # fmt: skip
    assert cfg.grader.spec() == {"name": "combine", "pattern": "", "components": [
        {"name": "gsm8k", "weight": 3.0, "pattern": ""}, {"name": "format", "weight": 1.0, "pattern": ""}]}  # fmt: skip
    for overrides, message in [
        (["grader.name=regex", "grader.pattern=[0-9]+"], "exactly one group"),
        (["grader.name=regex", "grader.pattern=(unclosed"], "not a regular expression"),
        (
            ["grader.name=combine", "grader.components=[{name: regex, pattern: '(x'}]"],
            r"grader\.components\.0\.pattern: not a regular expression",
        ),
        (["grader.name=combine"], "at least one component"),
        (["grader.components=[{name: gsm8k}]"], "only used with grader.name=combine"),
        (["grader.name=combine", "grader.components=[{name: gsm8k, weight: 0}]"], "greater than 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides, env={})


def test_every_grader_the_config_accepts_is_built_and_no_other() -> None:
    """The names come from one list (common.grader_names): each one the config takes for grader.name builds a grader,
    and a name the registry does not know is refused by the config, not discovered by the first actor."""
    from common import grader_names
    from common.config import ConfigError, GraderConfig, load_config

    assert set(GRADERS) == set(grader_names.PLAIN)
    for name in (*grader_names.BUILTIN, grader_names.COMBINE):
        components = [{"name": "exact"}] if name == grader_names.COMBINE else []
        pattern = "(\\d+)" if name == grader_names.REGEX else ""
        spec = GraderConfig(name=name, pattern=pattern, components=components).spec()
        grader = build_grader(spec)
        if name != "reasoning_gym":  # which grades where a problem came from: tests/unit/test_gym_task.py
            assert grader("7", "7") in (0.0, 1.0), name
    with pytest.raises(ConfigError, match=r"grader\.name: String should match pattern"):
        load_config(overrides=["grader.name=gsm9k"], env={})


def gsm8k_rows(shared_dir: Path, split: str) -> list[dict]:
    path = shared_dir / "data" / "gsm8k" / f"{split}.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_gsm8k_reference_grades_1_against_itself_and_0_when_changed(shared_dir: Path, split: str) -> None:
    rows = gsm8k_rows(shared_dir, split)
    assert len(rows) > 1000
    for row in rows:
        reference = row["answer"]
        assert gsm8k(reference, reference) == 1.0, reference[-80:]
        final = reference.rsplit("####", 1)[1].strip()
        changed = reference.rsplit("####", 1)[0] + "#### " + str(normalise_number(final) + 1)
        assert gsm8k(changed, reference) == 0.0, changed[-80:]
