"""The settings the fault tests' runs share: a small run on the demo model, quick to fail over."""

from __future__ import annotations

from pathlib import Path

# A restarted Redis is waited for (backoff at most 1 s, 30 attempts), not given up on.
PATIENT_REDIS = ("redis.backoff_max_s=1", "redis.retries=30")
LEASE_TTL_S = 5


def run_settings(url: str, model: Path, run_dir: Path, name: str, steps: int, batch: int, *extra: str) -> list[str]:
    """``-o`` arguments for a run of ``steps`` steps of ``batch`` groups of 4 under ``run.name=name``."""
    values = [
        f"redis.url={url}",
        f"model.path={model}",
        f"run.dir={run_dir}",
        f"run.name={name}",
        f"run.steps={steps}",
        f"learner.batch_groups={batch}",
        "learner.eval_every=1000",
        "learner.max_staleness=4",
        "sampling.group_size=4",
        "actor.prompts_per_round=4",
        "run.heartbeat_ttl_s=3",
        f"run.lease_ttl_s={LEASE_TTL_S}",  # a learner started right after a kill -9 takes the run over within it
        "task.eval_size=5",
        "grader.isolation=inline",
        *extra,
    ]
    return [a for v in values for a in ("-o", v)]
