"""The Redis side of the pipeline: key names, the groups stream, dead letters, weights announcements, counters.

Keys (all under ``grpo:{<run>}:``; the braces are a Redis Cluster hash tag, so a run's keys share one slot):

=====================  ==========  ======================================================================
``groups``             stream      scored groups, consumer group ``learners``; field ``data`` = msgpack
``dead``               stream      rejected messages (common.schemas.DeadLetter): ``reason``, ``payload`` (raw
                                   bytes), ``source_id``, ``at``, ``size``, ``truncated`` (a prefix of an oversized one)
``weights:latest``     hash        ``version``, ``uri``, ``digest``, ``format``, ``published_at``
``weights``            channel     pub/sub: the new version number (common.schemas.weights_wakeup), with the hash update
``prompts:cursor``     counter     shared by actors so replicas do not repeat prompts
``prompts:claims``     hash        rounds' claims on the positions they sample: holder -> ``<lease end ms>
                                   r<round> <positions>`` (common.schemas.PromptClaim; common.transport.prompts)
``prompts:redraw``     list        positions given back (a claim that expired or was let go), drawn before new ones
``prompts:last``       hash        holder -> its last draw or settling write (``draw <token> <positions>``,
                                   ``settled <token>``): a call sent again after a lost reply acts once
``prompts:trained``    bitmap      bit ``p`` set once the learner acknowledged position ``p``'s group as trained
``prompts:record``     hash        problem id -> its recent outcomes (``m``/``r``/``w`` per group; difficulty sampling,
                                   common.transport.difficulty)
``prompts:choices``    hash        ``taken:<pool>``, ``passed:<pool>``: cursor positions the difficulty sampler took or
                                   passed over
``actors:<id>``        string+TTL  heartbeat (JSON, common.schemas.Heartbeat)
``actor_ids``          hash        actor id -> the generation of the newest process that took it (actor.identity):
                                   an older process under the id is refused its next draw (transport.prompts.Superseded)
``stats``              hash        durable counters (common.schemas.RunCounters), see below
``done``               string      set by the learner after its last step (common.schemas.DoneMark); actors exit then
``trained_ids``        sorted set  group ids trained on, by step (a bounded window), to train a duplicate once
``inflight``           hash        rounds actors are sampling: holder -> ``<groups> <lease end, ms of Redis's clock>``
                                   (common.schemas.Reservation; the holder is the actor's id, ``<id>/<slot>`` for
                                   its other rounds in flight, actor/rounds.py)
``filtered``           hash        running sums over the groups actors filtered out (``groups``, ``zero_std_groups``,
                                   ``completions``, ``reward_sum``, ``reward_std_sum``): the learner's reward figures
``identity``           hash        the run's identity (common.schemas.RunIdentity: ``id``, ``created_at``), also in
                                   every checkpoint; and what a Redis that lost its data lost (``resets``,
                                   ``reset_at``, ``reset_step``, ``trained_before_reset``: groups trained before the
                                   loss, not in ``stats``)
``learner:lease``      hash+TTL    the learner that holds the run (common.schemas.LeaseHolder: ``token``, ``holder``,
                                   ``host``, ``pid``, ``since``), renewed from a thread; expires ``run.lease_ttl_s``
                                   after its last renewal
``learner:token``      counter     the last fencing token given: every new holder gets one above it
=====================  ==========  ======================================================================

Accounting. Every counter in ``stats`` is bumped in the same MULTI/EXEC transaction as the stream operation it
counts, so a crash can never separate the two:

    groups_produced = groups_trained + Σ groups_dropped:<reason> + groups_dead + XLEN(groups)

The learner deletes (XDEL) each entry in the transaction that acknowledges it, so the stream only ever holds
groups that are unread or pending; actors bound the unread ones with backpressure (checked in the script that
writes them), never with MAXLEN (trimming could drop a group nobody has trained on). Groups an actor filters out
never enter the stream and are counted apart as ``groups_filtered:<reason>``.

Room is reserved before sampling (``inflight``, :meth:`Transport.reserve_round`): an actor samples a round only while
the groups ahead of it (unread, plus rounds other actors are sampling) and the round itself can be trained before they
pass ``max_staleness``, so that generation is not spent on groups the learner will drop as stale.

The NCCL keys (``nccl:members``, ``nccl:round``, ``nccl:ready``, ``nccl:state``) carry weights over NCCL
(common.weights.nccl); their values, like every value here that one process writes for another, are forms of the
wire package (common.schemas).

:class:`ActorTransport` (the producer's view), :class:`LearnerTransport` (the consumer's) and :class:`Transport`
(the whole, for the operator) are built from parts, each in its own file, each with an actor's, a learner's or an
operator's side, all sharing one connection (common.transport.views says which view has which side):

===========================  ===============================================================================
common.transport.connection  the URL (plain, TLS, Sentinel), the bounded retries (a lost connection; a Redis that
                             refuses commands for now, such as a full one), key names, Lua registration
common.transport.refusals    the replies with which Redis refuses a command for now (full, busy ...), recognised
common.transport.admission   actors: writing rounds (settling their prompts' claims), reserving room for them
                             (``inflight``)
common.transport.prompts     actors: drawing prompt positions under a claim, giving them back; the prompts'
                             equation (operator)
common.transport.delivery    the learner: delivering within a byte budget, taking over, settling groups
common.transport.dead        dead letters: the learner moves them, the operator reads and replays them
common.transport.difficulty  actors: the problems' record for difficulty sampling; its counts (operator)
common.transport.members     heartbeats and NCCL members (actors), the actors alive and the NCCL rounds (learner)
common.transport.run         the announcement, done mark, identity and counters: read by all, written by the
                             learner; the runs in a Redis (operator)
common.transport.lease       the learner's lease, and the fence every write of the learner goes through
common.transport.views       the three views
===========================  ===============================================================================

Import every name from here.
"""

from __future__ import annotations

from common.transport.admission import Admission, MessageTooLarge, round_fits
from common.transport.connection import (
    CONSUMER_GROUP,
    Keys,
    RedisUnavailable,
    SentinelURL,
    TransportError,
    parse_sentinel_url,
)
from common.transport.delivery import DEAD_PREFIX_BYTES, Delivery, ReadLimits, StreamEntry
from common.transport.difficulty import choices_of
from common.transport.lease import LeaseHeld, LeaseLost, lease_line
from common.transport.prompts import ClaimLost, PromptBalance, Superseded
from common.transport.refusals import Refusal, refusal
from common.transport.run import Balance, read_balance
from common.transport.views import ActorTransport, LearnerTransport, Transport

__all__ = [
    "CONSUMER_GROUP",
    "DEAD_PREFIX_BYTES",
    "ActorTransport",
    "Admission",
    "Balance",
    "ClaimLost",
    "Delivery",
    "Keys",
    "LearnerTransport",
    "LeaseHeld",
    "LeaseLost",
    "MessageTooLarge",
    "PromptBalance",
    "ReadLimits",
    "RedisUnavailable",
    "Refusal",
    "SentinelURL",
    "StreamEntry",
    "Superseded",
    "Transport",
    "TransportError",
    "choices_of",
    "lease_line",
    "parse_sentinel_url",
    "read_balance",
    "refusal",
    "round_fits",
]
