"""``weights.transport: nccl`` with an engine whose requests go out from other threads (SGLang's rounds in flight, an
episode's later turns): the server takes a broadcast version's weights as they arrive, before its learner has
announced them (actor.weights.nccl), so a request sent meanwhile is answered by weights that may never be announced:
a learner frozen after its broadcast and fenced out of the run announces nothing, and a successor publishes its own
version under the same number.

:class:`Unannounced` keeps what the server is taking and the actor has not yet decided on. The engine takes a
broadcast only once the requests already on their way are answered (SGLang takes its model-update lock per bucket,
so a request that reached it between two buckets would run on part of the weights), and sends no new one until the
decision. A reply that reports weights being taken waits for the decision too: announced, it stands; dropped (or
undecided past the bound), its round is not sent (:class:`UnannouncedWeights`: the actor discards it, counted as
``groups_discarded:unannounced``), until announced weights replace the dropped ones.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager

from common.rollout import Sample


class UnannouncedWeights(RuntimeError):
    """A round (or a turn of it) was generated with weights that their learner never announced."""


class Unannounced:
    def __init__(self, wait_s: float):
        self.wait_s = wait_s  # the most a request or a reply waits for a decision
        self._decided = threading.Condition()
        self._receiving: str | None = None  # the weight_version the server is taking (or took), undecided
        self._dropped: set[str] = set()  # names of weights the server may still hold, never announced
        self._requests = 0  # sent and not yet answered

    def receiving(self, served: str, timeout_s: float) -> bool:
        """The server is to take weights that it will report as ``served``: no request is sent from now until the
        decision, and those on their way are answered first (False, nothing taken, when they are not within
        ``timeout_s``). A dropped version of that name stays dropped until these are announced."""
        with self._decided:
            self._receiving = served
            if self._decided.wait_for(lambda: self._requests == 0, timeout=timeout_s):
                return True
            self._receiving = None
            self._decided.notify_all()
            return False

    def announced(self) -> None:
        """The server holds announced weights only (a broadcast committed, or a version loaded from disk)."""
        with self._decided:
            self._receiving = None
            self._dropped.clear()
            self._decided.notify_all()

    def dropped(self, *also: str) -> None:
        """The weights being taken will never be announced (or arrived in part: the server may still report them
        under the name of those they were replacing, given in ``also``): until announced weights replace them, a
        reply that reports either name is not the policy's."""
        with self._decided:
            self._dropped.update(also)
            if self._receiving is not None:
                self._dropped.add(self._receiving)
            self._receiving = None
            self._decided.notify_all()

    @contextmanager
    def request(self) -> Iterator[frozenset[str]]:
        """Around a request, from before it is sent until its reply is in: waits while the server is taking
        weights, up to the bound; gives the names of the dropped weights the server may hold as it starts (announced
        weights of the same number may replace them while it runs, and the reply's names cannot tell which)."""
        with self._decided:
            if not self._decided.wait_for(lambda: self._receiving is None, timeout=self.wait_s):
                raise UnannouncedWeights(f"weights {self._receiving!r} were being taken for over {self.wait_s:.0f}s")
            self._requests += 1
            dropped = frozenset(self._dropped)
        try:
            yield dropped
        finally:
            with self._decided:
                self._requests -= 1
                self._decided.notify_all()

    def check(self, served: Collection[str], dropped_at_send: frozenset[str] = frozenset()) -> None:
        """Returns once a reply whose tokens came from the weights named ``served`` (every version it reports) is
        known to be announced weights' (at once, unless some are being taken); raises :class:`UnannouncedWeights`
        when any were dropped, before the request or since, or no decision came in time."""
        with self._decided:
            if not self._decided.wait_for(lambda: self._receiving not in served, timeout=self.wait_s):
                raise UnannouncedWeights(f"the server answered with weights {self._receiving!r} that were not "
                                         f"announced within {self.wait_s:.0f}s")  # fmt: skip
            if bad := sorted(set(served) & (self._dropped | dropped_at_send)):
                raise UnannouncedWeights(f"the server answered with weights {bad} that were never announced")


def reply_names(served: str | None, groups: Sequence[Sequence[Sample]]) -> set[str]:
    """Every weights name a reply reports: its newest, and with in-flight updates each token run's (the samples
    carry their versions as numbers, which are our names for versions)."""
    runs = {str(v) for g in groups for s in g for v, _ in s.versions}
    return runs | {served} if served is not None else runs
