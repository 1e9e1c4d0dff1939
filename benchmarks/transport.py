"""B3 transport: the project's path for a group — encode, XADD (the actors' bounded produce script), XREADGROUP,
decode, and the learner's acknowledgement (XACK + XDEL + trained-id window, one script) — against raw XADD,
XREADGROUP, XACK and XDEL of the same bytes, on the same private Redis, measured in the same run.

    .venv/bin/python benchmarks/transport.py [--quick] [--out result.json]

Groups are realistic: 16 completions of 512 tokens (and of 32 tokens), a 128-token prompt, int32 ids and float32
log-probs, sent in rounds of 16 groups (``actor.prompts_per_round``) and read in batches of 32
(``learner.batch_groups``). The two paths alternate, trial by trial, so drift on a noisy machine hits both; the
figure is the median over trials of project groups/s ÷ raw groups/s (goal ≥ 0.5). Prints one JSON object.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import harness  # noqa: E402
import numpy as np  # noqa: E402

from common.config import RedisConfig  # noqa: E402
from common.schemas import Completion, GroupMessage, decode_group, encode_group  # noqa: E402
from common.transport import CONSUMER_GROUP, Transport  # noqa: E402
from ops.redis_server import RedisServer  # noqa: E402

ROUND, BATCH = 16, 32


def make_groups(n: int, completion_len: int, group_size: int = 16, prompt_len: int = 128) -> list[GroupMessage]:
    rng = np.random.default_rng(0)
    return [
        GroupMessage(
            prompt_id=f"p{i}",
            policy_version=1,
            actor_id="bench",
            prompt_ids=rng.integers(0, 150_000, prompt_len, dtype=np.int32),
            completions=tuple(
                Completion(
                    rng.integers(0, 150_000, completion_len, dtype=np.int32),
                    -rng.random(completion_len, dtype=np.float32),
                    float(j % 2),
                    "stop",
                )
                for j in range(group_size)
            ),
        )
        for i in range(n)
    ]


def project_path(t: Transport, groups: list[GroupMessage]) -> float:
    """Seconds to move every group through the project's own path, actor side and learner side."""
    t0 = time.perf_counter()
    for i in range(0, len(groups), ROUND):
        t.produce([encode_group(g) for g in groups[i : i + ROUND]], bound=len(groups))
    left = len(groups)
    while left:
        entries = t.read("bench", BATCH, block_ms=1000)
        decoded = [decode_group(e.payload or b"") for e in entries]
        t.ack_trained([e.id for e in entries], [g.group_id for g in decoded], step=1)
        left -= len(entries)
    return time.perf_counter() - t0


def raw_path(t: Transport, payloads: list[bytes]) -> float:
    """Seconds for the same bytes through plain commands: pipelined XADDs, XREADGROUP, XACK + XDEL."""
    r, stream = t.client, t.keys.groups
    t0 = time.perf_counter()
    for i in range(0, len(payloads), ROUND):
        pipe = r.pipeline(transaction=False)
        for p in payloads[i : i + ROUND]:
            pipe.xadd(stream, {b"data": p})
        pipe.execute()
    left = len(payloads)
    while left:
        reply = r.xreadgroup(CONSUMER_GROUP, "raw", {stream: ">"}, count=BATCH, block=1000)
        ids = [i for _s, entries in reply for i, _f in entries]
        pipe = r.pipeline(transaction=False)
        pipe.xack(stream, CONSUMER_GROUP, *ids)
        pipe.xdel(stream, *ids)
        pipe.execute()
        left -= len(ids)
    return time.perf_counter() - t0


def measure(t: Transport, completion_len: int, n_groups: int, trials: int) -> dict[str, float]:
    groups = make_groups(n_groups, completion_len)
    payloads = [encode_group(g) for g in groups]
    ratios, project, raw, project_s, raw_s = [], [], [], [], []
    project_path(t, groups[:ROUND])  # warm up both paths (script loading, allocations)
    raw_path(t, payloads[:ROUND])
    for _ in range(trials):
        p = project_path(t, groups)
        r = raw_path(t, payloads)
        project_s.append(p)
        raw_s.append(r)
        project.append(n_groups / p)
        raw.append(n_groups / r)
        ratios.append(r / p)
    return {
        "completion_tokens": completion_len,
        "group_bytes": len(payloads[0]),
        "groups_per_trial": n_groups,
        "project_groups_per_s": statistics.median(project),
        "raw_groups_per_s": statistics.median(raw),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "goal": 0.5,
        "trials_project_s": project_s,  # each trial's seconds, that the figures above can be checked against
        "trials_raw_s": raw_s,
    }


def run(quick: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="grpo-bench-transport-") as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            t = Transport(RedisConfig(url=server.url), "bench-transport")
            t.ensure_consumer_group()
            cases = [
                measure(t, 512, 128 if quick else 256, 7 if quick else 9),
                measure(t, 32, 1024, 7 if quick else 9),
            ]
            t.close()
        finally:
            server.stop()
    return {"name": "B3 transport", "cases": cases, "ok": all(c["ratio"] >= c["goal"] for c in cases)}


def main() -> int:
    args = harness.parser(__doc__, "fewer groups and trials").parse_args()
    return harness.emit(run(args.quick), args.out)


if __name__ == "__main__":
    sys.exit(main())
