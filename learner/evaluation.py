"""The learner's held-out evaluation: greedy pass@1 on problems never used as RL prompts, graded as the actors grade.

It is the evaluation of ``grpo eval`` (common/tasks/evaluation.py), run with the learner's own model; under torchrun
every rank takes part (the model is sharded), and rank 0 records the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from common.config import Config
from common.idle_cores import CoreBorrower
from common.metrics import LearnerMetrics
from common.model.generation import generate
from common.rollout import SampleGrader
from common.tasks import PromptEncoder, eval_problems
from common.tasks.evaluation import score_problems, summarise
from env.episodes import episode_generate, open_episodes


class Evaluator:
    def __init__(
        self,
        cfg: Config,
        model: Any,
        tokenizer: Any,
        grader: SampleGrader,
        metrics: LearnerMetrics,
        stop_ids: set[int],
        pad_id: int,
        autocast: Callable[[], Any],
        cores: CoreBorrower | None = None,
    ):
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.grader = grader
        self.metrics = metrics
        # Only the held-out problems: the learner never needs the training prompts.
        self.problems = eval_problems(cfg.task, cfg.run.seed)
        self.encode = PromptEncoder(tokenizer, cfg.task)
        # With an environment, evaluated as trained, in episodes; a turn also stops at the environment's stop ids.
        self.stop_ids = set(stop_ids)
        self.episodes = open_episodes(cfg, tokenizer, self.stop_ids)
        self.pad_id = pad_id
        self.autocast = autocast  # the trainer's: forward passes in the precision training uses
        self.cores = cores  # the trainer's (learner.borrow_idle_cores): threads chosen at each decode step

    def _greedy(self, prompts: Any, n: int, _greedy: bool, _problems: Any) -> Any:
        return generate(self.model, prompts, n=n, max_new_tokens=self.cfg.sampling.max_new_tokens,
                        stop_ids=self.stop_ids, pad_id=self.pad_id, temperature=None,
                        each_step=self.cores.adjust if self.cores is not None else None)  # fmt: skip

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """``eval/accuracy`` (greedy pass@1) and the seconds it took."""
        t0 = time.perf_counter()
        with self.autocast():
            scores = score_problems(
                self.problems,
                self.encode,
                episode_generate(self.episodes, self._greedy),
                self.grader,
                self.tokenizer,
                n=0,
                batch=self.cfg.task.eval_batch,
                require_stop=self.cfg.task.require_stop,
            )
        accuracy = summarise(scores.greedy, scores.sampled)["pass_at_1"]
        self.metrics.eval_accuracy.set(accuracy)
        return {"eval/accuracy": accuracy, "time/eval_s": time.perf_counter() - t0}

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
