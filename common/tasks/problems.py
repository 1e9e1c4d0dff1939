"""Prompt sources: the demo's single-digit addition, or rows of a dataset (``task.name``).

A task is two lists of :class:`Problem`: the RL training prompts and the held-out evaluation problems, which are
never used as RL prompts. Actors walk the training prompts through the shared cursor in Redis: position p is element
``p mod n`` of the ``p div n``-th shuffled pass, so every replica computes the same order and no prompt is repeated
within a pass however many actors there are. The order is that of the rows as loaded, shuffled by ``run.seed``, so
every process must load the same rows (a file, a local dataset or a pinned hub revision do).

``addition``: the 100 sums ``"3+5="`` → ``"8"``, split once by ``run.seed`` into ``task.eval_size`` held-out problems
and the training prompts.

``arithmetic``: ``a op b`` for every ordered pair of operands in ``task.operands`` (``task.operation`` ``+`` or
``*``), the reference being the result. Held-out problems are chosen by *pair*: both ``7*8`` and ``8*7`` are held out
or both are trained on, so no held-out problem is a training problem written the other way round. Pairs are drawn by
``run.seed`` until at least ``task.eval_size`` problems are held out. The prompt is ``task.prompt_template`` of
``{a}``, ``{op}``, ``{b}`` and ``{expression}`` (empty: ``"7*8="``).

``dataset``: rows from ``task.path``, one of

- a ``.jsonl`` file (one JSON object per line), a ``.json`` file (a list of objects, or JSON lines) or a
  ``.parquet`` file (needs ``pyarrow``): the training rows are the file's;
- a directory of such files or a Hugging Face hub name, read with ``datasets.load_dataset(path, task.subset,
  split=...)`` (needs the ``data`` extra): the training rows are ``task.train_split``.

The held-out problems are the first ``task.eval_size`` rows (0: all) of ``task.eval_path`` (another file or dataset,
at ``task.eval_split``) or, when that is empty, of ``task.path``'s ``task.eval_split``; for a single file, or with
``task.eval_split`` empty, ``task.eval_size`` rows are held out of the training rows instead (chosen by
``run.seed``). A row's prompt is ``task.prompt_template`` formatted with the row's fields (``{question}``; empty:
the ``task.prompt_field`` as it is); its reference is ``task.answer_field``; its id is ``task.id_field`` or its row
number. The prompt is then wrapped in the tokenizer's chat template when it has one (``task.chat_template``), see
:class:`PromptEncoder`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import ConfigError, TaskConfig, template_fields

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    reference: str


class Task:
    def __init__(self, name: str, train: list[Problem], eval: list[Problem], seed: int):
        self.name = name
        self.train = train
        self.eval = eval
        self._seed = seed
        self._passes: dict[int, list[int]] = {}

    @property
    def all(self) -> list[Problem]:
        return self.train + self.eval

    def at(self, position: int) -> Problem:
        """The training prompt at a cursor position (see the module docstring)."""
        n = len(self.train)
        epoch, i = divmod(position, n)
        order = self._passes.get(epoch)
        if order is None:
            order = list(range(n))
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._passes = {epoch: order}  # positions only move forward: keep the current pass only
        return self.train[order[i]]


def _hold_out(problems: list[Problem], eval_size: int, seed: int, what: str) -> tuple[list[Problem], list[Problem]]:
    if not 1 <= eval_size < len(problems):
        raise ConfigError(
            f"config error: task.eval_size: {what} has {len(problems)} problems; hold out between 1 and "
            f"{len(problems) - 1} of them, got {eval_size}"
        )
    shuffled = list(problems)
    random.Random(seed).shuffle(shuffled)
    return shuffled[eval_size:], shuffled[:eval_size]


def addition_problems() -> list[Problem]:
    return [Problem(f"add-{a}-{b}", f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def addition_task(eval_size: int = 20, seed: int = 0) -> Task:
    train, held_out = _hold_out(addition_problems(), eval_size, seed, "the addition task")
    return Task("addition", train, held_out, seed)


def arithmetic_task(cfg: TaskConfig, seed: int) -> Task:
    """The ``arithmetic`` task (see the module docstring)."""
    low, high = cfg.operands
    op = cfg.operation
    template = cfg.prompt_template or "{expression}="
    pairs = [(a, b) for a in range(low, high + 1) for b in range(a, high + 1)]
    random.Random(seed).shuffle(pairs)
    total = (high - low + 1) ** 2
    if cfg.eval_size >= total:
        raise ConfigError(
            f"config error: task.eval_size: the arithmetic task has {total} problems, got {cfg.eval_size}"
        )
    train: list[Problem] = []
    held_out: list[Problem] = []
    for a, b in pairs:
        side = held_out if len(held_out) < cfg.eval_size else train
        for x, y in {(a, b), (b, a)}:
            expression = f"{x}{op}{y}"
            fields = {"a": x, "b": y, "op": op, "expression": expression}
            prompt = template.format_map(fields)
            result = x + y if op == "+" else x * y
            side.append(Problem(f"arith-{x}{'-plus-' if op == '+' else '-times-'}{y}", prompt, str(result)))
    return Task("arithmetic", sorted(train, key=lambda p: p.id), sorted(held_out, key=lambda p: p.id), seed)


# --- datasets -----------------------------------------------------------------------------------------------------


def is_file_source(path: str) -> bool:
    return Path(path).expanduser().is_file()


def load_rows(path: str, subset: str, split: str) -> list[dict[str, Any]]:
    """The rows of a file, or of one split of a local or hub dataset (see the module docstring). Raises
    :class:`ConfigError` naming ``path`` when it cannot be read."""
    local = Path(path).expanduser()
    if local.is_file():
        return _file_rows(local)
    if not local.exists() and path.startswith((".", "/", "~")):
        raise ConfigError(f"config error: task.path: {path}: no such file or directory (nor a hub name org/name)")
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"config error: task.path: reading {path} needs the datasets library: pip install 'grpo-pipeline[data]'"
        ) from None
    try:
        ds = datasets.load_dataset(path, subset or None, split=split)
    except Exception as e:  # datasets raises many kinds (missing split, no files, offline hub): all the user's to fix
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config error: task.path: cannot load {path} split {split!r}: {reason}") from None
    return [dict(row) for row in ds]


def _file_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(
                f"config error: task.path: {path} is parquet, which needs pyarrow: pip install 'grpo-pipeline[data]'"
            ) from None
        try:
            return list(pq.read_table(path).to_pylist())
        except Exception as e:  # pyarrow's errors for a damaged or foreign file
            raise ConfigError(f"config error: task.path: {path}: not a readable parquet file ({e})") from None
    if suffix not in (".jsonl", ".json"):
        raise ConfigError(f"config error: task.path: {path}: files must be {', '.join(FILE_SUFFIXES)}")
    text = path.read_text(encoding="utf-8")
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config error: task.path: {path}: not valid JSON ({e})") from None
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"config error: task.path: {path} line {lineno}: not valid JSON ({e})") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"config error: task.path: {path}: row {i + 1} is not a JSON object")
    return rows


def make_problems(rows: Iterable[Mapping[str, Any]], cfg: TaskConfig, source: str, prefix: str) -> list[Problem]:
    """Rows → problems, by the field mapping and template of ``cfg``. A missing field is a config error naming the
    setting, the field and the fields the rows do have."""
    fields = template_fields(cfg.prompt_template) if cfg.prompt_template else [cfg.prompt_field]
    problems = []
    for i, row in enumerate(rows):
        for setting, field in [
            *(("task.prompt_template" if cfg.prompt_template else "task.prompt_field", f) for f in fields),
            ("task.answer_field", cfg.answer_field),
            *([("task.id_field", cfg.id_field)] if cfg.id_field else []),
        ]:
            if field not in row:
                raise ConfigError(
                    f"config error: {setting}: {source} row {i + 1} has no field {field!r} "
                    f"(it has {', '.join(map(repr, row)) or 'none'})"
                )
        text = cfg.prompt_template.format_map(row) if cfg.prompt_template else str(row[cfg.prompt_field])
        pid = f"{prefix}-{row[cfg.id_field]}" if cfg.id_field else f"{prefix}-{i}"
        problems.append(Problem(pid, text, str(row[cfg.answer_field])))
    if not problems:
        raise ConfigError(f"config error: task.path: {source} has no rows")
    return problems


def _limit(problems: list[Problem], size: int) -> list[Problem]:
    return problems[:size] if size else problems


def eval_problems(cfg: TaskConfig, seed: int) -> list[Problem]:
    """The held-out problems alone: what ``grpo eval`` and the learner's evaluation grade. When they are a split of
    their own, only that split is read (the training rows are not needed)."""
    source = _eval_source(cfg) if cfg.name == "dataset" else None
    return _eval_split(cfg, source) if source else make_task(cfg, seed).eval


def _eval_source(cfg: TaskConfig) -> str | None:
    """Where held-out problems come from when they are a split of their own (``task.eval_path``, or
    ``task.eval_split`` of a directory or hub dataset); None when they are held out of the training rows."""
    if cfg.eval_path:
        return cfg.eval_path
    if cfg.path and cfg.eval_split and not is_file_source(cfg.path):
        return cfg.path
    return None


def _eval_split(cfg: TaskConfig, source: str) -> list[Problem]:
    """The first ``task.eval_size`` problems (0: all) of ``source``'s ``task.eval_split``."""
    rows = load_rows(source, cfg.subset, cfg.eval_split)
    return _limit(make_problems(rows, cfg, f"{source} ({cfg.eval_split})", "eval"), cfg.eval_size)


def make_task(cfg: TaskConfig, seed: int) -> Task:
    if cfg.name == "addition":
        return addition_task(cfg.eval_size, seed)
    if cfg.name == "arithmetic":
        return arithmetic_task(cfg, seed)
    if not cfg.path:
        raise ConfigError("config error: task.path: empty; task.name=dataset needs a file, a directory or a hub name")
    rows = load_rows(cfg.path, cfg.subset, cfg.train_split)
    train = make_problems(rows, cfg, f"{cfg.path} ({cfg.train_split})", "train")
    source = _eval_source(cfg)
    if source:
        held_out = _eval_split(cfg, source)
    else:
        train, held_out = _hold_out(train, cfg.eval_size, seed, cfg.path)
    train = _limit(train, cfg.train_size)
    return Task("dataset", train, held_out, seed)


# --- prompt → token ids -------------------------------------------------------------------------------------------


class PromptEncoder:
    """A problem's prompt → the token ids the engine is given.

    With a chat template (the tokenizer has one and ``task.chat_template`` is not ``off``) the prompt is the user
    message, after ``task.system_prompt`` when set, rendered with the generation prompt appended, as an instruct
    model was tuned to see it; the rendered text carries its own special tokens. Otherwise the prompt is tokenized
    as plain text (with the tokenizer's BOS, if it adds one)."""

    def __init__(self, tokenizer: Any, cfg: TaskConfig):
        self.tokenizer = tokenizer
        self.system_prompt = cfg.system_prompt
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if cfg.chat_template == "on" and not has_template:
            raise ConfigError("config error: task.chat_template: on, but the tokenizer of model.path has no template")
        self.chat = has_template and cfg.chat_template != "off"

    def text(self, prompt: str) -> str:
        """What the model reads, before tokenization."""
        if not self.chat:
            return prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        rendered = self.tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return str(rendered)

    def __call__(self, prompt: str) -> list[int]:
        if not self.chat:
            return list(self.tokenizer(prompt).input_ids)
        return list(self.tokenizer(self.text(prompt), add_special_tokens=False).input_ids)
