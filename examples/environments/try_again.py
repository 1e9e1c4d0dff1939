"""An environment of your own, chosen from the config: a wrong answer is told so and answered again.

    grpo run -o env.name=examples.environments.try_again:TryAgain -o env.max_turns=3

(``grpo`` imports it from the working directory, here the repository's root, or from ``PYTHONPATH``;
``-o 'env.args.feedback="..."'`` changes what the model is told). Each episode: the model answers; a right answer
ends it, a wrong one is answered with the feedback text and the model tries again, up to ``env.max_turns`` answers.
The reward is the grader's score of the last answer, as for every episode; the feedback is the environment's text,
never trained on.

What every environment implements (env.environment.Environment): ``stop_ids``, ``respond`` (one
:class:`Response` per :class:`Turn`: token ids to append, or ``ended`` with the reason) and ``close``. A turn carries
the model's token ids as its engine produced them, how it finished, its number in the episode and the problem its
prompt asks (``turn.problem.reference`` is what the grader gets: the answer, for the tasks whose reference is
one; a reasoning-gym problem's is where it came from).
"""

from __future__ import annotations

from typing import Any

from env.environment import Response, Turn


class TryAgain:
    def __init__(self, tokenizer: Any, feedback: str = " no, again:"):
        self.tokenizer = tokenizer
        # The environment's turn as token ids of its own: the model's tokens before it are never tokenized again.
        self.feedback = tuple(tokenizer.encode(feedback, add_special_tokens=False))
        self.stop_ids: set[int] = set()  # a turn ends at end-of-sequence (or the length limit) only

    def respond(self, turns: list[Turn]) -> list[Response]:
        return [self._respond(turn) for turn in turns]

    def _respond(self, turn: Turn) -> Response:
        if turn.finish_reason == "length":  # cut off: no answer to judge
            return Response(ended="length")
        answer = self.tokenizer.decode(list(turn.token_ids), skip_special_tokens=True).strip()
        if turn.problem is None or answer == turn.problem.reference:
            return Response(ended="answer")
        return Response(self.feedback)

    def close(self) -> None:
        pass
