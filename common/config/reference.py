"""The configuration reference, rendered from the tree: docs/configuration.md and ``grpo config --keys``."""

from __future__ import annotations

import json
from collections.abc import Iterator

from pydantic import BaseModel

from common.config.loading import ENV_KEYS
from common.config.tree import Config


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md is this text; a test keeps the two equal)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `common/config/` by `python -m common.config > docs/configuration.md`.",
        "Set values in YAML files (`--config FILE`, repeatable: later files override earlier ones key by key), in the",
        "environment (the variables below), or on the command line with `-o section.key=value` (values are read as",
        "YAML 1.2: only `true` and `false` are booleans, so `off` is the text off). Later sources win, in that order.",
        "`grpo config --keys` lists these keys in the terminal; `grpo config` prints the resolved tree.",
        "",
        "| environment variable | key |",
        "|---|---|",
        *[f"| `{var}` | `{key}` |" for var, key in ENV_KEYS.items()],
        "",
    ]
    for name, field in Config.model_fields.items():
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel)
        lines += [f"## `{name}`", "", "| key | default | meaning |", "|---|---|---|"]
        lines += _table_rows(name, section)
        lines.append("")
    return "\n".join(lines)


def _table_rows(prefix: str, model: type[BaseModel]) -> list[str]:
    return [
        f"| `{key}` | {default and f'`{default}`'} | {meaning} |" for key, default, meaning in key_rows(prefix, model)
    ]


def key_rows(prefix: str = "", model: type[BaseModel] | None = None) -> Iterator[tuple[str, str, str]]:
    """``(dotted key, default as JSON or "" when empty, meaning)`` for every key under ``model`` (the whole tree by
    default): the rows of docs/configuration.md and of ``grpo config --keys``."""
    for key, field in (model or Config).model_fields.items():
        dotted = f"{prefix}.{key}" if prefix else key
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from key_rows(dotted, sub)
            continue
        default = field.get_default(call_default_factory=True)
        shown = (
            "" if default in ("", None) else json.dumps(default if not isinstance(default, tuple) else list(default))
        )
        kind = str(field.annotation).replace("typing.", "")
        meaning = field.description or ""
        if "Literal[" in kind:
            meaning = (meaning + "; " if meaning else "") + "one of " + kind.split("Literal[", 1)[1].rstrip("]")
        yield dotted, shown, meaning
