"""The stand-in's ``/pause_generation`` and ``/continue_generation`` (tests/sglang_standin.py), as SGLang 0.5.23 does
them for the two modes the actor uses (``srt/managers/scheduler.py``, ``tokenizer_manager.py``):

- ``in_place``: requests stop between two decode steps and keep their cached keys and values; after a weights
  update they go on with the new weights over that cache;
- ``retract``: requests stop, their cache is dropped, and after ``/continue_generation`` prompt and output so far are
  prefilled again (with whatever weights are loaded by then);
- a request's reply says which version produced which output tokens (``meta_info.weight_versions`` spans), and a
  ``/generate`` sent while paused waits for ``/continue_generation``. ``abort`` (SGLang's default) is not modelled:
  the stand-in answers it with HTTP 400.

While paused in place, requests are still running, so a cache flush is refused; retracted ones leave the server
idle (the real scheduler ignores its waiting queue while paused), so a flush succeeds.
"""

from __future__ import annotations

import threading
from typing import Any

from actor.engines.recompute import generate_recomputing
from common.model.generation import generate
from common.rollout import Sample

MODES = ("in_place", "retract")


class Pause:
    def __init__(self, version: str):
        self.mode: str | None = None
        self.cond = threading.Condition()
        self.names = [version]  # every version name served, in order: samples record their index
        self.running = 0  # requests generating (or paused)
        self.held = 0  # requests stopped by the pause: between two steps (in place) or retracted
        self.retracts = 0  # retract pauses so far: a request retracted by one starts again after it

    # -- the endpoints ----------------------------------------------------------------------------------------

    def pause(self, body: dict) -> tuple[int, dict]:
        mode = body.get("mode", "abort")
        if mode not in MODES:
            return 400, {"error": {"message": f"the stand-in pauses in_place or retract, not {mode!r}"}}
        with self.cond:
            self.mode = mode
            self.retracts += mode == "retract"
            self.cond.notify_all()
            # The scheduler pauses between two steps: every running request has stopped when it answers (the real
            # one answers at once and handles the next message, the update, after the pause; same order).
            self.cond.wait_for(lambda: self.held >= self.running, timeout=30)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict) -> tuple[int, dict]:
        with self.cond:
            self.mode = None
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    # -- what generation and the scheduler ask --------------------------------------------------------------

    def serving(self, name: str) -> None:
        """The scheduler's version is now ``name`` (after a weights update)."""
        if name != self.names[-1]:
            self.names.append(name)

    def busy(self) -> bool:
        """Requests held in place are still running; retracted ones are not."""
        return self.running > 0 and self.mode != "retract"

    def wait_unpaused(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.mode is None)

    def _hold(self) -> None:  # between two decode steps: a request paused in place waits here, its cache kept
        with self.cond:
            if self.mode == "in_place":
                self._stopped(lambda: self.mode != "in_place")

    def _stopped(self, until: Any) -> None:
        self.held += 1
        self.cond.notify_all()
        self.cond.wait_for(until)
        self.held -= 1

    def generate(self, model: Any, prompts: list[list[int]], n: int, max_new_tokens: int, **kw: Any) -> list[Any]:
        """``n`` samples per prompt, each with the spans of the versions that produced its tokens."""

        def step(p: Any, k: int, most: int, interrupt: Any) -> list[list[Sample]]:
            return generate(model, p, n=k, max_new_tokens=most, each_step=self._hold, interrupt=interrupt,
                            version=lambda: len(self.names) - 1, **kw)  # fmt: skip

        with self.cond:
            self.running += 1
        try:
            return generate_recomputing(step, prompts, n, max_new_tokens, _Retraction(self))
        finally:
            with self.cond:
                self.running -= 1

    def spans(self, s: Sample) -> list[dict[str, Any]]:
        out, at = [], 0
        for index, k in s.versions:
            out.append({"version": self.names[index], "start": at, "end": at + k})
            at += k
        return out


class _Retraction:
    """One request's view of retract pauses (actor.engines.recompute's Updates): it stops at the first step after one,
    and waits, retracted, until generation continues, to be prefilled again."""

    def __init__(self, pause: Pause):
        self.pause = pause
        self.seen = pause.retracts

    def due(self) -> bool:
        return self.pause.retracts != self.seen

    def load(self) -> None:
        with self.pause.cond:
            self.seen = self.pause.retracts
            self.pause._stopped(lambda: self.pause.mode is None)
