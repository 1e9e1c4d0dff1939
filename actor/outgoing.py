"""What a graded round sends: DAPO's zero-std filter and the overlong penalty decide each group, the groups that go
become messages, and the round's counters say what became of the rest (the groups' fates, and the same fates for
their prompt positions, common.schemas.prompts). Pure but for a log line: the loop (:mod:`actor.loop`) writes the
result to Redis in one script."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from actor.filter import Decision, ZeroStdFilter, filtered_stats, overlong_penalties, shaped
from actor.message import group_message
from common.config import Config
from common.model.generation import Sample
from common.schemas import FORWARDED, PROMPTS_SENT, FilteredStats, counter, encode_group, prompt_counter
from common.tasks import Problem

log = logging.getLogger("actor")
FILTERED_ZERO_STD = counter("filtered", "zero_std")  # the stats field of the groups the zero-std filter keeps back
DISCARDED_OVERSIZED = counter("discarded", "oversized")  # groups over redis.max_message_bytes, never sent
# The same fates counted for the groups' prompt positions
_PROMPTS_FILTERED_ZERO_STD = prompt_counter("filtered", "zero_std")
_PROMPTS_DISCARDED_OVERSIZED = prompt_counter("discarded", "oversized")


@dataclass
class Outgoing:
    """A round's group messages to send, its counters (``stats`` increments: the groups' and their positions'),
    and the summary of the groups it filtered out (the learner's reward figures count them)."""

    payloads: list[bytes] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)
    filtered: FilteredStats = field(default_factory=FilteredStats)

    def discarded(self, reason: str) -> Counter[str]:
        """The counters of this round sent nowhere (``groups_discarded:<reason>``): its positions were drawn and
        sampled, and go no further either, for the same reason."""
        counters = Counter({**self.counters, counter("discarded", reason): len(self.payloads)})
        counters[prompt_counter("discarded", reason)] += counters.pop(PROMPTS_SENT, 0)
        return counters


class RoundEncoder:
    def __init__(self, cfg: Config, actor_id: str, max_message_bytes: int):
        self.cfg = cfg
        self.id = actor_id
        self.max_message_bytes = max_message_bytes
        self.filter = ZeroStdFilter(cfg.actor.filter_zero_std, cfg.actor.max_consecutive_filtered)
        self._warned_forward = False

    def encode(
        self,
        problems: Sequence[Problem],
        groups: Sequence[list[Sample]],
        rewards: Sequence[list[float]],
        *,
        prompt_ids: Callable[[Problem], list[int]],
        version_sampled: int,
        epochs: dict[int, int],
        positions: Sequence[int] | None = None,
    ) -> Outgoing:
        out = Outgoing()
        at: list[int | None] = list(positions) if positions is not None else [None] * len(problems)
        for problem, samples, r, position in zip(problems, groups, rewards, at, strict=True):
            # An episode's length is its last turn's, which sampling.max_new_tokens bounds as it bounds an answer.
            lengths = [len(x.token_ids) - x.answer_from for x in samples]
            penalties = overlong_penalties(lengths, self.cfg.sampling, self.cfg.shaping)
            decision = self.filter.decide(shaped(r, penalties))
            if decision is Decision.FILTER:
                out.filtered += filtered_stats(r)
                out.counters[FILTERED_ZERO_STD] += 1
                out.counters[_PROMPTS_FILTERED_ZERO_STD] += 1
                continue
            if decision is Decision.FORWARD:
                out.counters[FORWARDED] += 1
                self._warn_forward_once()
            message = group_message(problem, prompt_ids(problem), samples, r, penalties,
                                    forwarded=decision is Decision.FORWARD, actor_id=self.id,
                                    version_sampled=version_sampled, epochs=epochs, position=position)  # fmt: skip
            payload = encode_group(message)
            if len(payload) > self.max_message_bytes:  # the write script would refuse the round: not this group
                out.counters[DISCARDED_OVERSIZED] += 1
                out.counters[_PROMPTS_DISCARDED_OVERSIZED] += 1
                log.warning("discarding a group of %d bytes, over redis.max_message_bytes (%d)", len(payload),
                            self.max_message_bytes)  # fmt: skip
                continue
            out.payloads.append(payload)
            out.counters[PROMPTS_SENT] += 1
        return out

    def _warn_forward_once(self) -> None:
        if not self._warned_forward:
            self._warned_forward = True
            log.warning(
                "%d groups in a row had equal rewards (prompts too easy or too hard for the model): sending zero-std "
                "groups flagged so the learner does not starve (counted as zero_std_forwarded; warned once)",
                self.cfg.actor.max_consecutive_filtered,
            )
