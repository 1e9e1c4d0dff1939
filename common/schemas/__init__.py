"""Every message that crosses a process, in one place. msgpack only, never pickle.

Messages
--------
``GroupMessage`` (actor → Redis stream ``groups`` → learner)
    One prompt, its G completions with their behaviour log-probs and rewards, stamped with the policy version that
    generated them. Invariants, checked by :func:`decode_group`:

    - ``v`` is :data:`SCHEMA_VERSION` (or 1 to 5, read for groups still in a stream written by an older build) and
      ``type`` is ``"group"``; no unknown keys anywhere;
    - arrays travel as ``{"dtype": ..., "data": <little-endian bytes>}``, never as lists of numbers;
    - every completion has as many behaviour log-probs as tokens (at least one), log-probs are in
      [:data:`LOGPROB_FLOOR` = −1e4, 0]: a sampled token's log-prob is ≤ 0, and no sampler can draw a token whose
      probability its float format rounds to 0 (below e^-104 in float32, e^-745 in float64), so anything lower is
      corrupt (−1e30 made every update of a step non-finite); an environment token's (see ``mask``) may be NaN, a
      model token's never;
    - rewards are finite and in [0, 1]; ``policy_version`` ≥ 0; ``finish_reason`` is stop | length | abort;
    - ``zero_std`` is true only when the actor forwarded an all-equal group because its resampling budget ran out;
    - ``penalties`` (optional, float32, G, each in [−overlong_factor, 0]): DAPO's overlong penalty of each
      completion, computed once by an actor that shapes its rewards (``shaping.*``): its zero-std filter decided on
      rewards + penalties, and the learner's advantages use the very same numbers; absent, nothing is added;
    - what an actor filtered out is not carried by any group: the script that writes a round counts it in Redis (the
      ``filtered`` hash, common.transport), where a dropped group cannot take it along, and the learner reads it
      there. Versions 1 and 2 carried a ``filtered`` map for it, which is read and skipped;
    - ``epoch`` (optional, an int ≥ 0): the learner lineage of the weights it was sampled with, from their
      announcement; messages without it (earlier builds) are read by their version alone;
    - ``completions.versions`` (optional, version 4): which policy version produced which tokens, run-length encoded
      per completion (common.schemas.versions): ``runs`` (int32, G: runs per completion, each ≥ 1), ``version`` and
      ``tokens`` (int32, one per run: versions rising within a completion, each run ≥ 1 token, a completion's runs
      adding up to its length). Sent by actors that load weights mid-answer (``actor.weight_updates: in_flight``)
      when some token is older than the group's ``policy_version``, which is then the newest version any token
      holds; absent, every token is ``policy_version``'s.
    - ``completions.mask`` (optional, version 5): which tokens the model wrote (1) and which the environment did (0:
      a tool's output in a multi-turn episode, fed to the model but never trained on, its log-prob NaN), run-length
      encoded per completion as ``versions`` is (common.schemas.masks): ``runs`` (int32, G: runs per completion,
      each ≥ 1), ``value`` and ``tokens`` (int32, one per run: value 0 or 1, each run ≥ 1 token, a completion's runs
      adding up to its length, and at least one model token per completion). Sent only when some token of the group
      is the environment's; absent, every token is the model's. In memory: ``Completion.mask`` (uint8, L) and the
      column ``Completions.mask`` (uint8, N, or None).
    - ``position`` (optional, version 6, an int ≥ 0): the prompt cursor's position the group was drawn at
      (common.schemas.prompts): the learner marks it trained as it acknowledges the group; absent in older builds'
      messages (and allowed absent: a group written by hand).

Layout (version 6). The G completions travel as columns, not as G maps: ``completions`` is one map of
``lengths`` (int32, G), ``token_ids`` and ``logprobs`` (every completion's, end to end, ``sum(lengths)`` each),
``rewards`` (float64, G) and ``finish_reasons`` (G strings)::

    {"v": 6, "type": "group", "group_id": str, "prompt_id": str, "policy_version": int, "actor_id": str,
     "created_at": float, "prompt_ids": array, "zero_std": bool, ["penalties": array,] ["epoch": int,]
     ["position": int,]
     "completions": {"lengths": array, "token_ids": array, "logprobs": array, "rewards": array,
                     "finish_reasons": [str, ...], ["versions": {"runs", "version", "tokens"},]
                     ["mask": {"runs", "value", "tokens"}]}}

Why columns: a group is a handful of arrays whatever G is, so packing, unpacking and checking it costs a few numpy
calls instead of G small maps of nested maps; that halved the cost of moving a group through Redis (benchmark
B3). Version 5 was this layout without ``position``, version 4 it without ``mask`` too, version 3 it without
``versions`` either, version 2 it with ``filtered`` and without ``penalties``; version 1 carried ``completions`` as a
list of ``{"token_ids", "logprobs", "reward", "finish_reason"}`` maps; the decoder still reads all five (every
token the model's), so groups left in a stream by an older build are trained, not dead-lettered.

``WeightsAnnouncement`` (learner → Redis hash ``weights:latest`` + channel ``weights`` → actors)
    ``version``, ``uri`` (a directory), ``digest`` (``xxh3-128:<hex>`` or ``sha256:<hex>``, over its
    ``*.safetensors`` files in name order; an announcement with only the ``sha256`` field of earlier builds is
    read as ``sha256:<it>``), ``format``, ``published_at``, ``epoch`` (the learner lineage; 0 when absent).

``Heartbeat`` (actor → Redis string ``actors:<id>``, with a TTL → ``grpo status``, ``grpo run``'s view, the learner)
    JSON ``{"pid", "at", "version", "groups_sent", "rounds"}`` (the last three optional).

Weights over NCCL (learner ⇄ actors, through Redis; the protocol is common.weights.nccl's)
    ``NcclMember`` (actor → hash ``nccl:members``): JSON ``{"ranks", "nonce", "group", "at"}``, ``at`` on Redis's
    clock. ``NcclRound`` (learner → ``nccl:round``): compact JSON of the round and its ``Bucket``s (names, dtypes,
    shapes); its id is ``<session>:<seq>``, what members write to ``nccl:ready``. ``NcclDecision`` (learner →
    ``nccl:state``): ``<round id>:<join|go|cancel>``.

The run's state in Redis (common.schemas.state)
    ``RunCounters`` (hash ``stats``: ``groups_produced``, ``groups_trained``, ``groups_dead``,
    ``groups_replayed``, ``zero_std_forwarded`` and ``groups_<dropped|filtered|discarded>:<reason>``, each an
    integer; :func:`counter` names the last; the ``prompts_*`` fields are ``PromptCounters``', the prompts' own
    equation: common.schemas.prompts, with ``PromptClaim``, a field of the hash ``prompts:claims``),
    ``RunIdentity`` (hash ``identity``), ``DoneMark`` (string ``done``), ``DeadLetter`` (an entry of the stream
    ``dead``), ``Reservation`` (a field of the hash ``inflight``: ``<groups> <lease end ms>``) and the ``weights``
    channel's message (:func:`weights_wakeup`). The Lua scripts of common.transport write several of them; they
    write these forms, and tests read what they wrote back through them. ``prompts:cursor`` is a plain integer
    (INCRBY), ``prompts:redraw`` a list of positions, ``prompts:trained`` a bitmap of positions, and ``trained_ids``
    a sorted set of group ids scored by learner step.

The forms live in modules behind this face: the group message's encoding, decoding and validation
(common.schemas.group; its completions as columns, common.schemas.completions; their optional columns,
common.schemas.versions and common.schemas.masks), the small forms
above it (common.schemas.control), the run's state (common.schemas.state) and the prompts' accounting
(common.schemas.prompts); the field checks they share are in
common.schemas.fields. Import them from here.

A payload that fails here raises :class:`SchemaError` with a one-line reason; the learner moves it to the ``dead``
stream with that reason and the raw bytes.
"""

from __future__ import annotations

from common.schemas.completions import FINISH_REASONS, Completion, Completions, FilteredStats, FinishReason
from common.schemas.control import (
    DIGEST_HEX_LENGTHS,
    DTYPE_SIZES,
    DTYPES,
    WEIGHTS_FORMATS,
    Bucket,
    Heartbeat,
    NcclDecision,
    NcclDecisionName,
    NcclMember,
    NcclRound,
    WeightsAnnouncement,
)
from common.schemas.fields import SchemaError, as_text
from common.schemas.group import (
    LOGPROB_FLOOR,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    GroupMessage,
    decode_group,
    encode_group,
)
from common.schemas.prompts import (
    MAX_MARKED_POSITION,
    PROMPT_KINDS,
    PROMPTS_SENT,
    PromptClaim,
    PromptCounters,
    PromptKind,
    PromptPool,
    claims_of,
    prompt_counter,
)
from common.schemas.state import (
    COUNTER_KINDS,
    DEAD,
    DEAD_LETTER_FIELDS,
    FORWARDED,
    PRODUCED,
    REPLAYED,
    TRAINED,
    CounterKind,
    DeadLetter,
    DoneMark,
    DropReason,
    LeaseHolder,
    Reservation,
    RunCounters,
    RunIdentity,
    counter,
    weights_wakeup,
)
from common.schemas.versions import VersionRuns

__all__ = [
    "COUNTER_KINDS",
    "DEAD",
    "DEAD_LETTER_FIELDS",
    "DIGEST_HEX_LENGTHS",
    "DTYPES",
    "DTYPE_SIZES",
    "FINISH_REASONS",
    "FORWARDED",
    "LOGPROB_FLOOR",
    "MAX_MARKED_POSITION",
    "PRODUCED",
    "PROMPTS_SENT",
    "PROMPT_KINDS",
    "READABLE_VERSIONS",
    "REPLAYED",
    "SCHEMA_VERSION",
    "TRAINED",
    "WEIGHTS_FORMATS",
    "Bucket",
    "Completion",
    "Completions",
    "CounterKind",
    "DeadLetter",
    "DoneMark",
    "DropReason",
    "FilteredStats",
    "FinishReason",
    "GroupMessage",
    "Heartbeat",
    "LeaseHolder",
    "NcclDecision",
    "NcclDecisionName",
    "NcclMember",
    "NcclRound",
    "PromptClaim",
    "PromptCounters",
    "PromptKind",
    "PromptPool",
    "Reservation",
    "RunCounters",
    "RunIdentity",
    "SchemaError",
    "VersionRuns",
    "WeightsAnnouncement",
    "as_text",
    "claims_of",
    "counter",
    "decode_group",
    "encode_group",
    "prompt_counter",
    "weights_wakeup",
]
