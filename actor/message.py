"""A group's message from the actor's round: the pure mapping of samples (answers or whole episodes) and their
rewards onto :class:`common.schemas.GroupMessage`."""

from __future__ import annotations

import numpy as np

from common.rollout import Sample
from common.schemas import Completion, GroupMessage
from common.tasks import Problem


def group_message(
    problem: Problem,
    prompt_ids: list[int],
    samples: list[Sample],
    rewards: list[float],
    penalties: np.ndarray | None,
    *,
    forwarded: bool,
    actor_id: str,
    version_sampled: int,
    epochs: dict[int, int],
    position: int | None = None,
) -> GroupMessage:
    version, runs = _group_runs(samples, version_sampled)
    return GroupMessage(
        prompt_id=problem.id,
        policy_version=version,
        actor_id=actor_id,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        completions=tuple(
            Completion(
                np.asarray(s.token_ids, dtype=np.int32),
                np.asarray(s.logprobs, dtype=np.float32),  # NaN on an episode's environment tokens
                float(reward),
                s.finish_reason,  # type: ignore[arg-type]
                r,
                np.asarray(s.mask, dtype=np.uint8) if s.mask else None,  # which tokens the model wrote
            )
            for s, r, reward in zip(samples, runs, rewards, strict=True)
        ),
        zero_std=forwarded,
        penalties=penalties,
        epoch=epochs.get(version),
        position=position,
    )


def _group_runs(samples: list[Sample], version_sampled: int) -> tuple[int, list[np.ndarray | None]]:
    """The group's version and each completion's (version, tokens) runs. In-flight updates: the newest version of
    any token is the group's (admission goes by it). A completion that says nothing of its versions came from
    ``version_sampled`` whole. The runs are left out (None: every token of the group's version) only where every
    completion is one run of that version: were one older completion left without them, beside another that moved
    on, the learner would take its tokens for the newest and under-apply the stale-token mask."""
    runs = [tuple(s.versions) if s.versions else ((version_sampled, len(s.token_ids)),) for s in samples]
    version = max((r[-1][0] for r in runs if r), default=version_sampled)
    if all(len(r) <= 1 and all(v == version for v, _ in r) for r in runs):
        return version, [None] * len(samples)
    return version, [np.asarray(r, dtype=np.int32).reshape(-1, 2) for r in runs]
