"""A group's message from the actor's round: the pure mapping of samples (answers or whole episodes) and their
rewards onto :class:`common.schemas.GroupMessage`."""

from __future__ import annotations

import numpy as np

from common.model.generation import Sample
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
) -> GroupMessage:
    # In-flight updates: the newest version of any token is the group's (admission goes by it).
    version = max((s.versions[-1][0] for s in samples if s.versions), default=version_sampled)
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
                np.asarray(s.versions, dtype=np.int32) if s.versions else None,
                np.asarray(s.mask, dtype=np.uint8) if s.mask else None,  # which tokens the model wrote
            )
            for s, reward in zip(samples, rewards, strict=True)
        ),
        zero_std=forwarded,
        penalties=penalties,
        epoch=epochs.get(version),
    )
