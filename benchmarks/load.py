"""Load: many `sim` actors (random tokens at a set rate, no model) against one learner, on a private Redis.

    .venv/bin/python benchmarks/load.py                       # 32 actors, 60 s measured
    .venv/bin/python benchmarks/load.py --actors 4 --seconds 10 -o actor.sim_tokens_per_s=500

Every process is a real `grpo actor` / `grpo learner`. Once every actor has sent its first heartbeat, the stream is
sampled every second for ``--seconds``: its length, its unread and pending groups, and Redis's used memory. It
prints the figures and the bounds they are checked against, and exits 1 if one was exceeded:

- stream length <= actor.max_stream_groups + learner.batch_groups x checkpoint.every (unread groups are bounded by
  backpressure; read ones stay pending until the checkpoint that covers their step);
- the stream's memory (MEMORY USAGE) <= that many groups x the largest group's encoded size x 2;
- Redis used_memory <= its value before the run + the stream's bound above + the trained-group-id window at its
  cap (checkpoint.dedup_window x learner.batch_groups ids, 150 bytes each) + 1 MiB for the run's other keys.

It also reports the waste and the idling that backpressure trades against each other: the share of produced groups
dropped as stale, and the learner's idle share (its steps' ``time/wait_s`` over their ``time/step_s`` in
metrics.jsonl, for the steps taken while measuring).

All processes are stopped by PID at the end (SIGTERM, then SIGKILL), and the Redis with them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.children import stop_process, wait_until  # noqa: E402
from common.config import RedisConfig, load_config  # noqa: E402
from common.hardware import machine  # noqa: E402
from common.transport import Transport, read_balance  # noqa: E402
from ops.redis_server import RedisServer  # noqa: E402

DEFAULTS = [
    "run.name=load",
    "run.steps=1000000",
    "learner.eval_every=1000000",
    "task.eval_size=2",
    "actor.engine=sim",
    "actor.filter_zero_std=false",  # random tokens are all wrong: every group would be filtered
    "run.heartbeat_ttl_s=30",
    "grader.isolation=inline",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a temporary one)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="grpo-load-"))
    out.mkdir(parents=True, exist_ok=True)

    from ops.tiny_model import make_tiny_model

    model = out / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, warm=False)
    redis_server = RedisServer(out / "redis").start()
    procs: list[subprocess.Popen] = []
    t: Transport | None = None
    try:
        overrides = [*DEFAULTS, f"redis.url={redis_server.url}", f"model.path={model}", f"run.dir={out / 'run'}"]
        overrides += args.override
        cfg = load_config(None, overrides, env={})
        t = Transport(RedisConfig(url=redis_server.url), cfg.run.name)
        baseline = int(t.client.info("memory")["used_memory"])
        cli = [sys.executable, "-m", "common.cli"]
        flags = [a for o in overrides for a in ("-o", o)]
        logs = out / "logs"
        logs.mkdir(exist_ok=True)

        def start(*role: str, log: str) -> None:
            with (logs / log).open("ab") as f:
                procs.append(subprocess.Popen([*cli, *role, *flags], stdout=f, stderr=subprocess.STDOUT, cwd=REPO))

        t_start = time.perf_counter()
        start("learner", log="learner.log")
        for i in range(args.actors):
            start("actor", "-o", f"actor.id=sim-{i:02d}", log=f"actor-{i:02d}.log")
        if not wait_until(lambda: len(t.live_actors()) == args.actors or any(x.poll() for x in procs), 900, 1.0):
            print(f"only {len(t.live_actors())} of {args.actors} actors came up; see {logs}", file=sys.stderr)
            return 1
        if any(x.poll() is not None for x in procs):
            print(f"a process exited early; see {logs}", file=sys.stderr)
            return 1
        print(f"{args.actors} sim actors and a learner up after {time.perf_counter() - t_start:.0f}s; measuring")

        stream_bound = cfg.actor.max_stream_groups + cfg.learner.batch_groups * cfg.checkpoint.every
        samples = []
        first = read_balance(t)
        step0 = _step(t)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            b = read_balance(t)
            samples.append({"length": b.in_stream, "unread": b.unread, "pending": b.pending,
                            "stream_memory": int(t.client.memory_usage(t.keys.groups, samples=0) or 0),
                            "used_memory": int(t.client.info("memory")["used_memory"])})  # fmt: skip
            time.sleep(1.0)
        elapsed = time.perf_counter() - t0
        last = read_balance(t)
        steps = _step(t) - step0
        entries = t.client.xrange(t.keys.groups, count=1000)
        group_bytes = max((len(f[b"data"]) for _, f in entries), default=0)
        stream_memory_bound = 2 * stream_bound * group_bytes
        ids_bound = 150 * cfg.checkpoint.dedup_window * cfg.learner.batch_groups
        memory_bound = baseline + stream_memory_bound + ids_bound + 2**20
        trained_ids = int(t.client.zcard(t.keys.trained_ids))
        idle = _idle_share(Path(cfg.run.dir) / "metrics.jsonl", step0, step0 + steps)
    finally:
        for proc in procs:
            stop_process(proc, grace_s=20)
        final = read_balance(t) if t is not None else None
        redis_server.stop()

    peak_len = max(s["length"] for s in samples)
    peak_unread = max(s["unread"] for s in samples)
    peak_mem = max(s["used_memory"] for s in samples)
    report = {
        "machine": machine(),
        "actors": args.actors,
        "seconds": round(elapsed, 1),
        "sim_tokens_per_s_per_actor": cfg.actor.sim_tokens_per_s,
        "learner_steps": steps,
        "groups_produced_per_s": round((last.produced - first.produced) / elapsed, 1),
        "groups_trained_per_s": round((last.trained - first.trained) / elapsed, 1),
        "stream_length_max": peak_len,
        "stream_unread_max": peak_unread,
        "stream_pending_max": max(s["pending"] for s in samples),
        "stream_bound": stream_bound,
        "max_stream_groups": cfg.actor.max_stream_groups,
        "group_bytes_max": group_bytes,
        "groups_dropped": last.dropped,
        "stale_share_of_produced": round(final.dropped.get("stale", 0) / max(final.produced, 1), 3) if final else None,
        "learner_idle_share": round(idle, 3),
        "stream_memory_max_mb": round(max(s["stream_memory"] for s in samples) / 2**20, 2),
        "stream_memory_bound_mb": round(stream_memory_bound / 2**20, 2),
        "trained_ids_held": trained_ids,
        "redis_used_memory_before_mb": round(baseline / 2**20, 2),
        "redis_used_memory_max_mb": round(peak_mem / 2**20, 2),
        "redis_memory_bound_mb": round(memory_bound / 2**20, 2),
        "equation_after_stop": final.equation() if final else None,
    }
    (out / "load.json").write_text(json.dumps(report, indent=2))
    width = max(map(len, report))
    for k, v in report.items():
        print(f"{k:<{width}}  {v}")
    ok = peak_len <= stream_bound and peak_unread <= cfg.actor.max_stream_groups and peak_mem <= memory_bound
    ok = ok and max(s["stream_memory"] for s in samples) <= stream_memory_bound
    ok = ok and final is not None and final.unexplained == 0
    print("within bounds" if ok else "BOUND EXCEEDED", f"(figures in {out / 'load.json'})")
    return 0 if ok else 1


def _idle_share(metrics: Path, after: int, upto: int) -> float:
    """The learner's time waiting for groups over its steps' time, for the steps after ``after`` up to ``upto``."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/wait_s" in r and after < r["policy_version"] <= upto]
    return sum(r["time/wait_s"] for r in steps) / max(sum(r["time/step_s"] for r in steps), 1e-9)


def _step(t: Transport) -> int:
    ann = t.latest_weights()
    return 0 if ann is None else ann.version


if __name__ == "__main__":
    sys.exit(main())
