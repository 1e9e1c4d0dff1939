"""Loading the tree: defaults < YAML files < environment < ``-o`` overrides, and errors that name the field.

Files merge left to right (mappings key by key, a list is replaced whole). A validation error becomes one
:class:`ConfigError` line per problem; an unknown key gets the nearest key of its section as a suggestion, or its new
place when it moved.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from common.config.tree import Config
from common.config.yaml12 import read_yaml


class ConfigError(ValueError):
    """A user's configuration mistake: the message names the field and is fit to print as is."""


# Environment variables read into the tree; the names are documented in the README (Configuration).
ENV_KEYS: dict[str, str] = {
    "GRPO_REDIS_URL": "redis.url",
    "GRPO_REDIS_USERNAME": "redis.username",
    "GRPO_REDIS_PASSWORD": "redis.password",
    "GRPO_RUN_NAME": "run.name",
    "GRPO_RUN_DIR": "run.dir",
    "GRPO_MODEL_PATH": "model.path",
    # Compose gives every run a weights directory of its own on the shared volume (/weights/<run.name>).
    "GRPO_WEIGHTS_DIR": "weights.dir",
    "GRPO_TASK_PATH": "task.path",
    "GRPO_SGLANG_URL": "sglang.url",
    "GRPO_SGLANG_PYTHON": "sglang.python",
}


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"config error: {key!r}: not a dotted key such as learner.lr")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: {'.'.join(parts[: depth + 1])}: is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``"learner.lr=1e-3"`` → ``("learner.lr", 1e-3)``; the value is read as YAML (numbers, booleans, lists),
    except that a text key takes the text as written unless YAML reads it as a string too: a template such as
    ``task.prompt_template={question} Answer:`` is not a YAML mapping, and quotes still work."""
    key, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"config error: override {item!r} is not key=value")
    key = key.strip()
    try:
        value = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if not isinstance(value, str) and _is_text_key(key):
        value = raw
    return key, value


def _is_text_key(key: str) -> bool:
    """Whether the dotted ``key`` is a text field of the tree (an override then keeps its value as written)."""
    node: Any = Config
    for part in key.split("."):
        field = getattr(node, "model_fields", {}).get(part)
        if field is None:
            return False
        node = field.annotation
    return node is str


# Keys that moved to a shared section, because both roles read them (a role reads only its own section and the
# shared ones): an older config names the new place instead of failing with a guess.
MOVED = {"actor.group_size": "sampling.group_size", "actor.heartbeat_ttl_s": "run.heartbeat_ttl_s"}


def _format_errors(err: ValidationError) -> str:
    """pydantic's errors as :class:`ConfigError` lines, one per problem, each naming its dotted key."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            hint = f"; it is {MOVED[field]} now" if field in MOVED else _suggestion(e["loc"])
            lines.append(f"config error: {field}: unknown key{hint}")
            continue
        got = e.get("input")
        shown = "" if isinstance(got, dict) or e["type"] == "missing" else f" (got {got!r})"
        msg = e["msg"].removeprefix("Value error, ")
        # A section's own check names the key itself ("task.eval_size: ..."): no need to say the section again.
        prefix = "" if msg.startswith(f"{field}.") else f"{field}: "
        lines.append(f"config error: {prefix}{msg}{shown}")
    return "\n".join(lines)


def _suggestion(loc: Sequence[int | str]) -> str:
    """``; did you mean learner.lr?`` for the key at ``loc`` (``learner.lrr``), from its section's keys."""
    model = _model_at(loc[:-1])
    keys = list(model.model_fields) if model is not None else []
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if not near:
        return "; see grpo config --keys"
    return "; did you mean " + ".".join([*(str(p) for p in loc[:-1]), near[0]]) + "?"


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The section (or list item, such as a grader component) that ``loc`` names in the tree, or None."""
    node: Any = Config
    for part in loc:
        if isinstance(part, int):
            node = next(iter(get_args(node)), None)  # list[GraderComponent] -> GraderComponent
            continue
        field = getattr(node, "model_fields", {}).get(part)
        if field is None:
            return None
        node = field.annotation
    return node if isinstance(node, type) and issubclass(node, BaseModel) else None


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, anything else (a list too) is replaced whole."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config error: --config {p}: no such file")
    try:
        loaded = read_yaml(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config error: {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config error: {p}: the top level must be a mapping of sections")
    return loaded


ConfigPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None


def _path_list(path: ConfigPaths) -> list[str | os.PathLike[str]]:
    if path is None:
        return []
    if isinstance(path, (str, os.PathLike)):
        return [path]
    return list(path)


def load_config(
    path: ConfigPaths = None,
    overrides: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Defaults < YAML files (one path or a list, merged left to right) < environment < ``-o`` overrides.
    Raises :class:`ConfigError`."""
    tree: dict[str, Any] = {}
    for p in _path_list(path):
        tree = _merge(tree, _read_file(p))
    environ = os.environ if env is None else env
    for var, key in ENV_KEYS.items():
        if environ.get(var):
            _set_dotted(tree, key, environ[var])
    for item in overrides:
        _set_dotted(tree, *parse_override(item))
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
    cfg.run.dir = str(Path(cfg.run.dir).expanduser().resolve())
    cfg.weights.dir = str(Path(cfg.weights.dir).expanduser().resolve())
    cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir).expanduser().resolve())
    return cfg


def write_resolved(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved tree as JSON (temp name, then rename, so a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cfg.resolved_dict(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
