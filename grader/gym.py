"""The ``reasoning_gym`` grader: a reasoning-gym dataset's own ``score_answer``, run like every grader (in the
worker process, under ``grader.timeout_s`` and ``grader.memory_mb``).

The reference of a reasoning-gym problem (common.tasks.gym) is not an answer but where the problem came from
(common.gym_reference). The dataset is rebuilt from it (once per worker) and its entry regenerated, so that
``score_answer`` gets the whole entry, metadata included, as the library's own training loops give it: a dataset
whose answers are not one string (several right ones, a tolerance, a partial credit) is judged its own way. An entry
whose question and answer are not those the reference's fingerprint names (a dataset that generates differently in
this interpreter) is not judged: the grader raises, the answer scores 0, counted (``exception``).

The answer, the convention written in docs/tasks.md: the text inside the completion's last ``<answer>…</answer>``
(reasoning-gym's own ``extract_answer``: the instruction the prompt ends with asks for it); without one, the
completion's last non-empty line, stripped (a small model that answers plainly still gets judged). A score outside
[0, 1] is refused as a grader's is (``invalid``).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from common import gym_reference

_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def answer_text(completion: str) -> str:
    """What the completion answers (see the module docstring): its last answer tag's text, else its last line."""
    tagged = _ANSWER.findall(completion)
    if tagged:
        return str(tagged[-1]).strip()
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reasoning_gym(completion: str, reference: str) -> float:
    library = _library()  # first: the worker's warm-up call imports it, not the first answer's time limit
    where = gym_reference.decode(reference)
    dataset = _dataset(library, where["d"], json.dumps(where["c"], sort_keys=True), where["s"], where["n"])
    entry = dataset[where["i"]]
    if gym_reference.fingerprint(entry) != where["q"]:
        raise ValueError(f"{where['d']} item {where['i']} regenerated another question or answer than the task's")
    return float(dataset.score_answer(answer_text(completion), entry))


@functools.cache
def _library() -> Any:
    import reasoning_gym  # the reasoning-gym extra: loaded only where this grader runs (a second, at most)

    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _dataset(library: Any, name: str, config_json: str, seed: int, size: int) -> Any:
    """A dataset as common.tasks.gym built it (a reasoning-gym dataset is a pure function of these)."""
    return library.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
