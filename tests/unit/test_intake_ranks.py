"""A batch's groups as rank 0 sends them to the other ranks under torchrun (learner.intake): a group of an earlier
epoch that the intake renumbered into this epoch's versions reaches every rank as rank 0 trains on it, its version
runs included, where sent as it was renumbered the wire would refuse it (its newest run no longer its version)."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import numpy as np
import pytest

from actor.message import group_message
from common.rollout import Sample
from common.schemas import SchemaError, decode_group, encode_group
from common.tasks import Problem
from learner.intake import from_rank0, to_ranks


def spanning_group():  # type: ignore[no-untyped-def]
    """A group whose answers span versions 9 and 10 (in-flight updates), as the actor sent it."""
    samples = [Sample([1, 2, 3], [0.0] * 3, "stop", ((9, 2), (10, 1))), Sample([4, 5], [0.0] * 2, "stop")]
    msg = group_message(Problem("p", "q", "1"), [5, 6], samples, [1.0, 0.0], None, forwarded=False, actor_id="a",
                        version_sampled=10, epochs={})  # fmt: skip
    return decode_group(encode_group(msg))


def over_ranks(sent):  # type: ignore[no-untyped-def]
    return msgpack.unpackb(msgpack.packb(sent, use_bin_type=True), raw=False)  # learner.distributed's broadcast


def test_a_renumbered_group_with_version_runs_reaches_every_rank_as_rank_0_trains_on_it() -> None:
    aligned = replace(spanning_group(), policy_version=3)  # an earlier epoch's v10 is this epoch's v3

    with pytest.raises(SchemaError, match="newest version 10 is not policy_version 3"):
        decode_group(encode_group(aligned))  # sent as it was renumbered: refused on every other rank
    got = from_rank0(over_ranks(to_ranks(aligned)))

    assert got.policy_version == 3 and got.group_id == aligned.group_id
    for a, b in zip(got.completions, aligned.completions, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert (a.runs is None) == (b.runs is None)
        if a.runs is not None and b.runs is not None:
            assert np.array_equal(a.runs, b.runs)


def test_a_group_of_this_epoch_travels_unchanged() -> None:
    msg = spanning_group()
    body, version = to_ranks(msg)
    assert body == encode_group(msg) and version == 10
    assert from_rank0(over_ranks((body, version))).policy_version == 10
