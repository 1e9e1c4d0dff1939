"""Each role's view of the run's keys (part of common.transport), built from the parts' sides, so that a role's
object has no method of the other side: an actor cannot settle a group, a learner cannot produce one.

- :class:`ActorTransport`, the producer's: writing rounds and reserving room for them, drawing prompt positions
  under a claim and the problems' record (difficulty sampling), its
  heartbeat and its part in the NCCL rounds, and what it reads of the run (the announced weights, the done mark).
- :class:`LearnerTransport`, the consumer's: reading, taking over and settling groups, dead-lettering, the actors
  alive and the NCCL rounds it opens and decides, the lease and every write of the run's state behind its fence.
- :class:`Transport`, the whole: both views, and what the operator reads and replays (``grpo status``, ``grpo
  dead``, ``grpo run``).
"""

from __future__ import annotations

from common.transport.admission import Producing
from common.transport.dead import DeadLettering, DeadLetters
from common.transport.delivery import Delivering
from common.transport.difficulty import ProblemRecords, ProblemRecordsReading
from common.transport.members import Fleet, Member
from common.transport.prompts import Drawing, PromptsReading
from common.transport.run import RunAdmin, RunReading, RunWriting


class ActorTransport(Producing, Drawing, ProblemRecords, Member, RunReading):
    """An actor's connection to its run's keys."""


class LearnerTransport(Delivering, DeadLettering, Fleet, RunWriting, RunReading):
    """A learner's connection to its run's keys; its writes are fenced once it holds the lease."""


class Transport(ActorTransport, LearnerTransport, DeadLetters, RunAdmin, ProblemRecordsReading, PromptsReading):
    """One connection with every method: the operator's, and the tests' that play both roles."""
