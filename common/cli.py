"""The ``grpo`` command. Subcommands are entry points of the group ``grpo.commands`` (see pyproject.toml): each role
registers its own, so this module knows no role, and heavy libraries are imported only after arguments parse.
``grpo config`` is built in: it only reads the config tree, which lives here in common/.

Exit codes: 0 done (or stopped on request); 2 a user's mistake (invalid config, Redis unreachable at start or a
refused password or command, missing model path, a run, weights or checkpoint directory that is read-only or full),
one line on stderr; 3 Redis lost mid-run and still unreachable after ``redis.retries`` reconnect attempts, or
refusing commands for now (full, busy ...) for ``redis.full_wait_s`` (a supervisor restarts the process; nothing is
lost, see docs/operations.md, "What survives what"); 4 the run is held by another live learner (``learner.if_held:
exit``, or ``learner.held_wait_s`` spent waiting); 5 the learner found another one had taken its run over, or an actor
found a newer process under its ``actor.id``, and stopped at once; 130 Ctrl-C. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

import yaml

from common.config import Config, ConfigError, key_rows, load_config
from common.storage import StorageError, storage_errno

EXIT_USAGE = 2
EXIT_REDIS_LOST = 3
EXIT_LEASE_HELD = 4
EXIT_LEASE_LOST = 5


DISTRIBUTION = "grpo-pipeline"


def registered_commands() -> dict[str, object]:
    """The subcommands the installed roles registered, by name (entry points, loaded only when run)."""
    return {ep.name: ep for ep in entry_points(group="grpo.commands")}


def plain_text(text: str) -> str:
    """Docstring markup (reStructuredText) as the terminal should show it: ``:func:`f``` and ````x```` become f and
    x, a trailing ``::`` a colon."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"`([^`]+)`", r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)


def first_paragraph(doc: str | None) -> str:
    """A command's description for its ``--help``: the first paragraph of its module's docstring."""
    return (doc or "").strip().split("\n\n", 1)[0]


class PlainHelpFormatter(argparse.HelpFormatter):
    """Help of every command in plain text: descriptions and option help come from docstrings written in RST."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))


def role_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every command that loads the config takes: ``--config FILE`` and ``-o KEY=VALUE``."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=PlainHelpFormatter)
    parser.add_argument(
        "--config",
        metavar="FILE",
        action="append",
        default=[],
        help="YAML config, repeatable: later files override earlier ones key by key (defaults: the CPU demo)",
    )
    parser.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, repeatable: -o learner.lr=1e-3 -o run.steps=50",
    )
    return parser


def parse_config(prog: str, description: str, argv: Sequence[str]) -> Config:
    args = role_parser(prog, description).parse_args(list(argv))
    return load_config(args.config, args.override)


def config_main(argv: Sequence[str]) -> int:
    parser = role_parser(
        "grpo config",
        "Print the resolved config (defaults < --config files < environment < -o), secrets left out, as YAML a "
        "--config file takes; nothing runs and nothing is written.",
    )
    parser.add_argument("--json", action="store_true", help="JSON instead of YAML")
    parser.add_argument("--keys", action="store_true", help="list every key with its default and meaning instead")
    args = parser.parse_args(list(argv))
    if args.keys:
        print(keys_text(), end="")
        return 0
    tree = load_config(args.config, args.override).resolved_dict()
    print(json.dumps(tree, indent=2) if args.json else yaml.safe_dump(tree, sort_keys=False, width=1000), end="")
    return 0


def keys_text() -> str:
    """Every key, its default and its meaning, one line each: the rows of docs/configuration.md, as plain text."""
    rows = list(key_rows())
    key_width = max(len(key) for key, _, _ in rows)
    default_width = 12  # a longer default (a list) pushes its meaning right rather than widening every line
    return "".join(
        f"{key:<{key_width}}  {default or '-':<{default_width}}  {plain_text(meaning)}\n"
        for key, default, meaning in rows
    )


# Commands of this module, beside those registered as entry points: name -> (function, one line for grpo --help).
BUILTIN_COMMANDS = {
    "config": (config_main, "print the resolved config (secrets left out) without running anything; --keys: every key"),
}


def summary(name: str, module: str) -> str:
    """One line about command ``name`` from its module's docstring, read without importing the module (``--help``
    stays fast): the text after ````grpo NAME ...``:`` where the docstring has one, else its first line."""
    spec = importlib.util.find_spec(module)
    source = spec.origin if spec is not None else None
    doc = ast.get_docstring(ast.parse(Path(source).read_text())) if source and source.endswith(".py") else None
    lines = (doc or "").splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"``grpo {re.escape(name)}(?=[ `])[^`]*``:", line):
            paragraph = [line.split("``:", 1)[1]]
            for following in lines[i + 1 :]:
                if not following.strip() or following.startswith("``grpo "):
                    break
                paragraph.append(following)
            return plain_text(" ".join(part.strip() for part in paragraph)).strip().rstrip(".")
    return plain_text(lines[0]).strip().rstrip(".") if lines else ""


def help_text(commands: dict[str, object]) -> str:
    """``grpo --help``: every command with one line, and the options of grpo itself."""
    lines = {name: summary(name, ep.module) for name, ep in commands.items()}  # type: ignore[attr-defined]
    lines.update({name: line for name, (_, line) in BUILTIN_COMMANDS.items()})
    width = max(map(len, lines))
    return "\n".join(
        [
            "usage: grpo COMMAND [--config FILE ...] [-o KEY=VALUE ...]",
            "       grpo COMMAND --help   the options of one command",
            "",
            "commands:",
            *(f"  {name:<{width}}  {lines[name]}" for name in sorted(lines)),
            "",
            "options:",
            f"  {'-h, --help':<{width}}  this list",
            f"  {'--version':<{width}}  the version of {DISTRIBUTION}",
            "",
        ]
    )


def installed_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown (not installed: pip install -e .)"


def storage_problem(e: BaseException) -> str | None:
    """The one line for a directory that cannot take a write (read-only, full, over the file-size limit), or None
    for any other error, which keeps its traceback. A bare OSError counts only when it names its file."""
    if isinstance(e, StorageError):
        return str(e)
    if isinstance(e, OSError) and e.filename is not None and (number := storage_errno(e)) is not None:
        return f"{e.filename}: {os.strerror(number)}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Your graders, tools and environments (module.path:name) are found in the working directory first, as the
    # processes `grpo run` starts (python -m common.cli, python -m grader.worker) find them: the `grpo` script,
    # which Python starts with its own folder on the path instead, checks them as they will run.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    commands = registered_commands()
    if not commands:
        print("grpo: no subcommands registered; install the package (pip install -e .)", file=sys.stderr)
        return EXIT_USAGE
    if argv and argv[0] == "--version":
        print(f"{DISTRIBUTION} {installed_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text(commands), end="")
        return 0 if argv else EXIT_USAGE
    name, rest = argv[0], argv[1:]
    if name not in commands and name not in BUILTIN_COMMANDS:
        known = sorted([*commands, *BUILTIN_COMMANDS])
        near = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {near[0]}?" if near else f"choose from {', '.join(known)}"
        print(f"grpo: unknown command {name!r}; {hint}", file=sys.stderr)
        return EXIT_USAGE
    return run_command(name, rest, commands)


def run_command(name: str, argv: list[str], commands: dict[str, object]) -> int:
    """Run command ``name``; a user's mistake becomes one line on stderr and its exit code (the module docstring's
    list), a bug keeps its traceback."""
    import redis

    from common.transport import LeaseHeld, LeaseLost, RedisUnavailable, TransportError

    try:
        builtin = BUILTIN_COMMANDS.get(name)
        command = builtin[0] if builtin else commands[name].load()  # type: ignore[attr-defined]
        return int(command(argv) or 0)
    except (ConfigError, TransportError) as e:
        print(f"grpo {name}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (StorageError, OSError) as e:
        if (line := storage_problem(e)) is None:
            raise
        # Nothing is lost: groups are acknowledged only once the checkpoint that covers them is on disk.
        print(f"grpo {name}: {line}; free space or fix permissions and start it again", file=sys.stderr)
        return EXIT_USAGE
    except redis.exceptions.NoPermissionError as e:
        print(
            f"grpo {name}: Redis refused a command to this user ({e}); see the ACL in docs/operations.md",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except RedisUnavailable as e:  # a ConnectionError, so before the clause below: it says what Redis is in
        print(f"grpo {name}: {e}; exiting", file=sys.stderr)
        return EXIT_REDIS_LOST
    except (redis.ConnectionError, redis.TimeoutError) as e:
        # Only raised once the transport's bounded reconnects (logged "attempt i/n") are used up.
        print(
            f"grpo {name}: lost Redis and could not reconnect within redis.retries attempts ({e}); exiting",
            file=sys.stderr,
        )
        return EXIT_REDIS_LOST
    except LeaseHeld as e:
        print(f"grpo {name}: {e}", file=sys.stderr)
        return EXIT_LEASE_HELD
    except LeaseLost as e:
        print(f"grpo {name}: stopped: {e}", file=sys.stderr)
        return EXIT_LEASE_LOST
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
