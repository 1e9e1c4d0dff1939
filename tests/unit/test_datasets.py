"""Datasets as tasks (common.tasks): files, dataset directories, field mapping, templates, held-out splits, chat
templates, and a clear config error for every way a dataset can be wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.config import ConfigError, TaskConfig, load_config
from common.tasks import PromptEncoder, eval_problems, make_task

ROWS = [{"q": f"What is {a} plus {b}?", "a": str(a + b), "key": f"p{a}{b}"} for a in range(5) for b in range(4)]


def task_cfg(**kw: Any) -> TaskConfig:
    return TaskConfig(name="dataset", prompt_field="q", answer_field="a", **kw)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_jsonl_file_holds_out_eval_size_rows_by_seed(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "sums.jsonl", ROWS)
    task = make_task(task_cfg(path=str(path), eval_size=5), seed=3)
    assert len(task.train) == 15 and len(task.eval) == 5
    assert {p.prompt for p in task.all} == {r["q"] for r in ROWS}  # every row once
    assert not {p.id for p in task.train} & {p.id for p in task.eval}
    assert next(p for p in task.all if p.prompt == "What is 3 plus 2?").reference == "5"
    again, other = (
        make_task(task_cfg(path=str(path), eval_size=5), 3),
        make_task(task_cfg(path=str(path), eval_size=5), 4),
    )
    assert [p.id for p in again.eval] == [p.id for p in task.eval] != [p.id for p in other.eval]
    # The cursor walks every training prompt once per pass, the same order in every replica.
    assert sorted(task.at(i).id for i in range(15)) == sorted(p.id for p in task.train)
    assert [again.at(i).id for i in range(30)] == [task.at(i).id for i in range(30)]


def test_template_ids_train_size_and_json_lists(tmp_path: Path) -> None:
    path = tmp_path / "sums.json"
    path.write_text(json.dumps(ROWS))  # a JSON list, not lines
    cfg = task_cfg(path=str(path), eval_size=2, train_size=4, id_field="key",
                   prompt_template="Q: {q}\nA ({{int}}):")  # fmt: skip
    task = make_task(cfg, 0)
    assert len(task.train) == 4 and len(task.eval) == 2
    p = task.train[0]
    row = next(r for r in ROWS if f"train-{r['key']}" == p.id)
    assert p.prompt == f"Q: {row['q']}\nA ({{int}}):" and p.reference == row["a"]


def test_parquet_reads_like_jsonl(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="the data extra (pyarrow) is not installed")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "sums.parquet")
    write_jsonl(tmp_path / "sums.jsonl", ROWS)
    a = make_task(task_cfg(path=str(tmp_path / "sums.parquet"), eval_size=4), 0)
    b = make_task(task_cfg(path=str(tmp_path / "sums.jsonl"), eval_size=4), 0)
    assert a.all == b.all


def test_a_dataset_directory_has_train_and_test_splits(tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="the data extra (datasets) is not installed")
    write_jsonl(tmp_path / "ds" / "train.jsonl", ROWS[:15])
    write_jsonl(tmp_path / "ds" / "test.jsonl", ROWS[15:])
    task = make_task(task_cfg(path=str(tmp_path / "ds"), eval_size=0), 0)
    assert [p.prompt for p in task.train] == [r["q"] for r in ROWS[:15]]
    assert [p.prompt for p in task.eval] == [r["q"] for r in ROWS[15:]]  # the whole test split, in order
    assert [p.prompt for p in make_task(task_cfg(path=str(tmp_path / "ds"), eval_size=2), 0).eval] == [
        r["q"] for r in ROWS[15:17]
    ]  # the first eval_size of it
    # eval_split empty: held out of the training split instead.
    held = make_task(task_cfg(path=str(tmp_path / "ds"), eval_split="", eval_size=3), 0)
    assert len(held.train) == 12 and len(held.eval) == 3
    # A split that is not there names the setting.
    with pytest.raises(ConfigError, match=r"task.path: cannot load .* split 'validation'"):
        make_task(task_cfg(path=str(tmp_path / "ds"), eval_split="validation"), 0)


def test_eval_path_is_read_alone_for_evaluation(tmp_path: Path) -> None:
    evals = write_jsonl(tmp_path / "held.jsonl", ROWS[:6])
    cfg = task_cfg(path=str(tmp_path / "absent.jsonl"), eval_path=str(evals), eval_size=0)
    assert [p.prompt for p in eval_problems(cfg, 0)] == [r["q"] for r in ROWS[:6]]  # training rows never read
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[6:])
    task = make_task(cfg.model_copy(update={"path": str(train)}), 0)
    assert len(task.train) == 14 and [p.id for p in task.eval] == [f"eval-{i}" for i in range(6)]


@pytest.mark.parametrize(
    ("content", "kw", "message"),
    [
        ('{"q": "1+1", "b": "2"}\n', {}, r"task.answer_field: .* row 1 has no field 'a' \(it has 'q', 'b'\)"),
        ('{"q": "1+1", "a": "2"}\n', {"prompt_template": "{q} {hint}"}, r"task.prompt_template: .* no field 'hint'"),
        ('{"q": "1+1", "a": "2"}\n', {"id_field": "uid"}, r"task.id_field: .* no field 'uid'"),
        ('{"q": "1+1", "a": "2"}\n{"q": \n', {}, r"task.path: .* line 2: not valid JSON"),
        ('["q"]\n', {}, r"task.path: .* row 1 is not a JSON object"),
        ("\n\n", {}, r"task.path: .* has no rows"),
    ],
)
def test_bad_rows_are_config_errors_naming_the_setting(tmp_path: Path, content: str, kw: dict, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        make_task(task_cfg(path=str(path), eval_size=1, **kw), 0)


def test_bad_paths_and_settings_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "rows.csv").write_text("q,a\n")
    for path, message in [
        (str(tmp_path / "nope.jsonl"), "no such file or directory"),
        (str(tmp_path / "rows.csv"), r"files must be \.jsonl, \.json, \.parquet"),
        ("", "task.path: empty"),
    ]:
        with pytest.raises(ConfigError, match=message):
            make_task(task_cfg(path=path), 0)
    write_jsonl(tmp_path / "two.jsonl", ROWS[:2])
    with pytest.raises(ConfigError, match=r"task.eval_size: .* has 2 problems; hold out between 1 and 1"):
        make_task(task_cfg(path=str(tmp_path / "two.jsonl"), eval_size=5), 0)
    for overrides, message in [
        (
            ["task.name=dataset", "task.prompt_template={0} and {q.x}"],
            r"^config error: task.prompt_template: \{0\} is not a field",
        ),
        (["task.name=dataset", "task.prompt_template=unclosed {q"], "task.prompt_template"),
        (["task.eval_size=0"], "task.eval_size: the addition task"),
        (["task.name=jsonl"], "task.name"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides, env={})


def test_gsm8k_as_a_file_and_as_a_dataset_directory(shared_dir: Path) -> None:
    pytest.importorskip("datasets", reason="the data extra (datasets) is not installed")
    from grader import get_grader

    root = shared_dir / "data" / "gsm8k"
    if not root.is_dir():
        pytest.skip(f"{root} is absent")
    template = "{question}\nGive the final answer after ####."
    task = make_task(TaskConfig(name="dataset", path=str(root), eval_size=0, prompt_template=template), 0)
    assert (len(task.train), len(task.eval)) == (7473, 1319)
    assert task.eval[0].prompt.startswith("Janet") and task.eval[0].prompt.endswith("after ####.")
    gsm8k = get_grader("gsm8k")
    assert all(gsm8k(p.reference, p.reference) == 1.0 for p in task.eval)
    from_file = make_task(TaskConfig(name="dataset", path=str(root / "test.jsonl"), eval_size=100), 0)
    assert (len(from_file.train), len(from_file.eval)) == (1219, 100)


# --- chat templates -----------------------------------------------------------------------------------------------

CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from ops.tiny_model import build_tokenizer

    return build_tokenizer()


def test_chat_template_wraps_the_prompt_when_the_tokenizer_has_one(tokenizer: Any) -> None:
    plain = PromptEncoder(tokenizer, TaskConfig())
    assert not plain.chat and plain("3+5=") == list(tokenizer("3+5=").input_ids)  # no template: plain text
    with pytest.raises(ConfigError, match=r"task\.chat_template: on"):
        PromptEncoder(tokenizer, TaskConfig(chat_template="on"))

    tokenizer.chat_template = CHAT
    try:
        enc = PromptEncoder(tokenizer, TaskConfig(system_prompt="be brief"))
        assert enc.chat
        assert enc.text("3+5=") == "<system>be brief</system><user>3+5=</user><assistant>"
        assert enc("3+5=") == list(tokenizer(enc.text("3+5="), add_special_tokens=False).input_ids)
        assert PromptEncoder(tokenizer, TaskConfig()).text("3+5=") == "<user>3+5=</user><assistant>"
        off = PromptEncoder(tokenizer, TaskConfig(chat_template="off"))
        assert not off.chat and off("3+5=") == plain("3+5=")
    finally:
        tokenizer.chat_template = None


@pytest.mark.parametrize(("operation", "operands", "eval_size"), [("*", (2, 12), 40), ("+", (10, 99), 200)])
def test_arithmetic_holds_out_whole_pairs(operation: str, operands: tuple[int, int], eval_size: int) -> None:
    cfg = TaskConfig(name="arithmetic", operation=operation, operands=operands, eval_size=eval_size,  # type: ignore[arg-type]
                     prompt_template="What is {expression}? ({a} {op} {b})")  # fmt: skip
    task = make_task(cfg, seed=3)
    low, high = operands
    assert len(task.all) == (high - low + 1) ** 2 == len({p.id for p in task.all})  # every ordered pair, once
    assert eval_size <= len(task.eval) <= eval_size + 1  # pairs are held out whole: one may bring its twin
    pairs = {p.id: p for p in task.all}
    for p in task.eval:  # the other order of a held-out problem is held out too: never a training prompt
        x, y = p.id.removeprefix("arith-").split("-plus-" if operation == "+" else "-times-")
        twin = f"arith-{y}{'-plus-' if operation == '+' else '-times-'}{x}"
        assert pairs[twin] in task.eval
        a, b = int(x), int(y)
        assert p.reference == str(a + b if operation == "+" else a * b)
        assert p.prompt == f"What is {a}{operation}{b}? ({a} {operation} {b})"
    assert not {p.prompt for p in task.train} & {p.prompt for p in task.eval}
    assert make_task(cfg, seed=3).eval == task.eval and make_task(cfg, seed=4).eval != task.eval  # by run.seed


def test_arithmetic_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"task\.operands"):
        load_config(overrides=["task.name=arithmetic", "task.operands=[5, 5]"], env={})
    with pytest.raises(ConfigError, match=r"task\.eval_size"):
        make_task(TaskConfig(name="arithmetic", operands=(0, 2), eval_size=9), seed=0)
    assert make_task(TaskConfig(name="arithmetic", eval_size=20), seed=0).train[0].prompt.endswith("=")
