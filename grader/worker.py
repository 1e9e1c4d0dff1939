"""``python -m grader.worker NAME|SPEC_JSON``: grade frames from stdin, write one result frame per answer to stdout.

Request: a list of ``[completion, reference]``. Reply per answer, in order: ``[index, score, error_kind | None]``.
Started and killed by :class:`grader.pool.GraderPool`; msgpack frames, never pickle.
"""

from __future__ import annotations

import sys


def main() -> int:
    import json

    from grader import build_grader
    from grader.pool import read_frame_blocking, score_one, write_frame

    arg = sys.argv[1]
    fn = build_grader(json.loads(arg) if arg.startswith("{") else arg)  # a name, or a spec with options
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a grader that prints must not corrupt the frame stream
    write_frame(stdout, "ready")
    while (batch := read_frame_blocking(stdin)) is not None:
        for index, (completion, reference) in enumerate(batch):
            write_frame(stdout, [index, *score_one(fn, completion, reference)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
