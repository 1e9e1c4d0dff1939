"""The ``grpo`` command. Subcommands are entry points of the group ``grpo.commands`` (see pyproject.toml): each role
registers its own, so this module knows no role, and heavy libraries are imported only after arguments parse.

Exit codes: 0 done (or stopped on request); 2 a user's mistake (invalid config, Redis unreachable at start or a
refused password or command, missing model path, a run, weights or checkpoint directory that is read-only or full),
one line on stderr; 3 Redis lost mid-run and still unreachable after
``redis.retries`` reconnect attempts (a supervisor restarts the process; nothing is lost, see the README's "Operating
it"); 130 Ctrl-C. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from common.config import Config, ConfigError, load_config
from common.storage import StorageError, storage_errno

EXIT_USAGE = 2
EXIT_REDIS_LOST = 3


def _commands() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group="grpo.commands")}


def role_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", metavar="FILE", help="YAML config (defaults: the CPU demo)")
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, repeatable: -o learner.lr=1e-3 -o run.steps=50",
    )
    return p


def parse_config(prog: str, description: str, argv: Sequence[str]) -> Config:
    args = role_parser(prog, description).parse_args(list(argv))
    return load_config(args.config, args.override)


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
    commands = _commands()
    if not commands:
        print("grpo: no subcommands registered; install the package (pip install -e .)", file=sys.stderr)
        return EXIT_USAGE
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: grpo {" + ",".join(sorted(commands)) + "} [--config FILE] [-o key=value ...]")
        print("       grpo COMMAND --help   for the options of one command")
        return 0 if argv else EXIT_USAGE
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"grpo: unknown command {name!r}; choose from {', '.join(sorted(commands))}", file=sys.stderr)
        return EXIT_USAGE
    import redis

    from common.transport import TransportError

    try:
        fn = commands[name].load()  # type: ignore[attr-defined]
        return int(fn(rest) or 0)
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
        print(f"grpo {name}: Redis refused a command to this user ({e}); see the ACL in the README", file=sys.stderr)
        return EXIT_USAGE
    except (redis.ConnectionError, redis.TimeoutError) as e:
        # Only raised once the transport's bounded reconnects (logged "attempt i/n") are used up.
        print(
            f"grpo {name}: lost Redis and could not reconnect within redis.retries attempts ({e}); exiting",
            file=sys.stderr,
        )
        return EXIT_REDIS_LOST
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
