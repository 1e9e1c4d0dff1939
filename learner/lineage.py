"""Which learner step a policy version's weights are, across learner crashes.

A version names the weights of one learner step: within one learner's life, version = first version + (step − the
step it started from). A learner that crashed may have published versions of steps no checkpoint has; the next one
resumes from the newest checkpoint (an earlier step) and, since a version must never go back or name two different
weights, announces those weights under a new, higher version: a new *epoch* of the lineage begins. The versions the
dead learner published past the checkpoint are a dead branch: no later policy descends from them.

An epoch is ``(epoch, step, version)``: its number, the step it resumed from and its first version (the weights of
that step). The table is kept in every checkpoint (each epoch resumed from a checkpoint written by the epoch before
it), so staleness is measured in learner steps within the lineage: a group sampled with weights that are an
ancestor of the current policy is ``current step − the step of its weights`` old, and one sampled from a dead
branch is not the current policy's past at all (the learner drops it as ``lineage``).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.schemas import DropReason


@dataclass(frozen=True)
class Epoch:
    epoch: int
    step: int  # the learner step it started from
    version: int  # its first version: the weights of that step


class Lineage:
    """The epochs of the current policy's lineage, oldest first (pure logic; the learner persists it)."""

    def __init__(self, epochs: list[Epoch] | None = None):
        self.epochs = list(epochs) if epochs else [Epoch(0, 0, 0)]

    @classmethod
    def from_json(cls, rows: list[list[int]] | None) -> Lineage:
        return cls([Epoch(int(e), int(s), int(v)) for e, s, v in rows] if rows else None)

    def to_json(self) -> list[list[int]]:
        return [[e.epoch, e.step, e.version] for e in self.epochs]

    @property
    def current(self) -> Epoch:
        return self.epochs[-1]

    def begin(self, epoch: int, step: int, version: int) -> None:
        """A new epoch: the weights of ``step`` (of the current lineage) are announced again as ``version``."""
        last = self.current
        if epoch <= last.epoch or step < last.step or version <= self.version_at(step):
            raise ValueError(f"epoch {epoch} at step {step}, version {version} does not continue {last}")
        self.epochs.append(Epoch(epoch, step, version))

    def version_at(self, step: int) -> int:
        """The version the current epoch gives the weights of ``step`` (a step of its lineage)."""
        return self.current.version + step - self.current.step

    def age(self, version: int, epoch: int | None, step: int) -> tuple[DropReason | None, int]:
        """How many learner steps the weights ``version`` are behind ``step`` (the current one): ``(None, age)``, or
        why no age can be given: ``("future", 0)`` for weights this lineage has not reached (a newer learner's),
        ``("lineage", 0)`` for a dead branch's. ``epoch``: the group's
        own stamp when it has one; it must agree with the epoch its version falls in."""
        if epoch is not None and epoch > self.current.epoch:
            return "future", 0
        for i in range(len(self.epochs) - 1, -1, -1):
            e = self.epochs[i]
            # Below the first epoch it knows, the lineage counts back from it: a checkpoint of an earlier build knows
            # only its own step and version, and the versions before were that learner's own past.
            if version < e.version and i > 0:
                continue
            if epoch is not None and epoch != e.epoch:
                return "lineage", 0  # a stamp that disagrees with its version: an epoch no checkpoint recorded
            at = e.step + version - e.version
            if i + 1 < len(self.epochs) and at > self.epochs[i + 1].step:
                return "lineage", 0  # published after the step the next epoch resumed from: a dead branch
            return ("future", 0) if at > step else (None, step - at)
        raise AssertionError("unreachable: the first epoch takes every version")
