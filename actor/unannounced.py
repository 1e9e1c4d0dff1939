"""``weights.transport: nccl`` with an engine whose requests go out from other threads (SGLang's rounds in flight, an
episode's later turns): the server takes a broadcast version's weights as they arrive, before its learner has
announced them (actor.nccl_weights), so a request sent meanwhile is answered by weights that may never be announced:
a learner frozen after its broadcast and fenced out of the run announces nothing, and a successor publishes its own
version under the same number.

:class:`Unannounced` keeps what the server is taking and the actor has not yet decided on. A request waits for the
decision before it is sent, and a reply that reports such a version waits for it too: announced, the reply stands;
dropped (or still undecided past the bound), its round is not sent (:class:`UnannouncedWeights`: the actor discards
it, counted as ``groups_discarded:unannounced``), until announced weights replace the dropped ones.
"""

from __future__ import annotations

import threading


class UnannouncedWeights(RuntimeError):
    """A round (or a turn of it) was generated with weights that their learner never announced."""


class Unannounced:
    def __init__(self, wait_s: float):
        self.wait_s = wait_s  # the most a reply waits for the decision (the actor's wait for the announcement)
        self._decided = threading.Condition()
        self._receiving: str | None = None  # the weight_version the server is taking (or took), undecided
        self._dropped: set[str] = set()  # names of weights the server may still hold, never announced

    def receiving(self, served: str) -> None:
        """The server starts taking weights that it will report as ``served``."""
        with self._decided:
            self._receiving = served  # (a dropped version of that name stays dropped until these are announced)

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

    def sending(self) -> frozenset[str]:
        """Before a request: waits while the server is taking weights (sent now, it would be served by part of them,
        SGLang loading each bucket as it comes, or by weights not announced yet), up to the bound; then the names of
        the dropped weights the server may hold as the request starts (announced weights of the same number may
        replace them while it runs, and the reply's name cannot tell which it had). Requests sent before stay
        whole: each holds SGLang's model-update lock, so the first bucket waits for them."""
        with self._decided:
            if not self._decided.wait_for(lambda: self._receiving is None, timeout=self.wait_s):
                raise UnannouncedWeights(f"weights {self._receiving!r} were being taken for over {self.wait_s:.0f}s")
            return frozenset(self._dropped)

    def check(self, served: str | None, dropped_at_send: frozenset[str] = frozenset()) -> None:
        """Returns once a reply generated with ``served`` is known to be announced weights' (at once, unless they
        are being taken); raises :class:`UnannouncedWeights` when they were dropped, before the request or since,
        or no decision came in time."""
        if served is None:
            return
        with self._decided:
            if not self._decided.wait_for(lambda: served != self._receiving, timeout=self.wait_s):
                raise UnannouncedWeights(f"the server answered with weights {served!r} that were not announced "
                                         f"within {self.wait_s:.0f}s")  # fmt: skip
            if served in self._dropped or served in dropped_at_send:
                raise UnannouncedWeights(f"the server answered with weights {served!r} that were never announced")
