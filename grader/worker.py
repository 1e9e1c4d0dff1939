"""``python -m grader.worker NAME|SPEC_JSON``: grade frames from stdin, write one result frame per answer to stdout.

Request: a list of ``[completion, reference]``. Reply per answer, in order: ``[index, score, error_kind | None]``.
Started and killed by :class:`grader.session.Session`; msgpack frames, never pickle.

With a spec ``{"tool": "module.path:function", "max_chars": N}`` it runs a tool instead (env.tools.ToolPool's):
request a list of calls (text), reply per call ``[index, result | None, error_kind | None]``.

The worker imports only the graders and :mod:`grader.protocol` (never the roles' libraries, torch:
hundreds of megabytes and seconds per restart), and it warms up before it says "ready": a grader's first call
imports what it needs (math-verify pulls in sympy) and builds its parsers, which must not count against the first
answer's time limit.
"""

from __future__ import annotations

import sys
from typing import Any

# Graded once before "ready": every built-in grader parses it, and a grader that rejects it is still warm.
_WARM_UP = ("1", "1")


def warm_up(fn: Any) -> None:
    """Grade a trivial answer, ignoring its score or error: what matters is what the first call imported."""
    from grader.protocol import score_one

    score_one(fn, *_WARM_UP)


def main() -> int:
    import json

    from grader import build_grader
    from grader.protocol import read_frame_blocking, score_one, write_frame

    arg = sys.argv[1]
    spec = json.loads(arg) if arg.startswith("{") else arg  # a name, or a spec with options
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a grader that prints must not corrupt the frame stream
    if isinstance(spec, dict) and "tool" in spec:
        return serve_tool(spec, stdin, stdout)
    fn = build_grader(spec)
    warm_up(fn)
    write_frame(stdout, "ready")
    while (batch := read_frame_blocking(stdin)) is not None:
        for index, (completion, reference) in enumerate(batch):
            write_frame(stdout, [index, *score_one(fn, completion, reference)])
    return 0


def serve_tool(spec: dict[str, Any], stdin: Any, stdout: Any) -> int:
    from grader import import_function
    from grader.protocol import read_frame_blocking, run_tool, write_frame

    fn, max_chars = import_function(spec["tool"], "tool", "calculator"), int(spec["max_chars"])
    run_tool(fn, "1", max_chars)  # warm: what its first call imports does not count against a call's time limit
    write_frame(stdout, "ready")
    while (batch := read_frame_blocking(stdin)) is not None:
        for index, call in enumerate(batch):
            write_frame(stdout, [index, *run_tool(fn, call, max_chars)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
