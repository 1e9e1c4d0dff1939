"""Staleness along a policy's lineage (learner.lineage), and the epoch stamps that carry it on the wire."""

from __future__ import annotations

import msgpack
import pytest

from common.schemas import SchemaError, WeightsAnnouncement, decode_group, encode_group
from learner.lineage import Epoch, Lineage
from tests.unit.test_schemas import make_group


def crashed_once() -> Lineage:
    """Epoch 0 trained steps 0..5 (versions 0..5) and checkpointed step 3; the learner was killed; epoch 1 resumed
    from step 3 and announced those weights as version 6 (above the 5 already out)."""
    lineage = Lineage()
    lineage.begin(1, 3, 6)
    return lineage


def test_one_epoch_is_todays_rule_in_steps() -> None:
    lineage = Lineage()
    assert lineage.age(4, None, 6) == (None, 2)
    assert lineage.age(6, 0, 6) == (None, 0)
    assert lineage.age(7, None, 6) == ("future", 0)


def test_after_a_crash_ancestors_are_aged_in_steps_and_the_dead_branch_is_lineage() -> None:
    lineage = crashed_once()
    step = 4  # epoch 1 has trained one step: version 7
    assert lineage.version_at(step) == 7
    # Weights of steps 0..3 are this policy's past: 3 is one step old (versions alone would say 7 - 3 = 4).
    assert lineage.age(3, 0, step) == (None, 1)
    assert lineage.age(2, None, step) == (None, 2)
    # Versions 4 and 5: steps 4 and 5 of the killed learner, after the checkpoint: no later policy descends from them.
    assert lineage.age(4, 0, step) == ("lineage", 0)
    assert lineage.age(5, None, step) == ("lineage", 0)
    assert lineage.age(6, 1, step) == (None, 1) and lineage.age(7, 1, step) == (None, 0)
    assert lineage.age(8, 1, step) == ("future", 0)


def test_an_epoch_stamp_that_disagrees_with_its_version_is_lineage_and_a_newer_one_future() -> None:
    lineage = crashed_once()
    # Epoch 1 stamped on version 5: an epoch numbered 1 by a learner that died before any checkpoint recorded it.
    assert lineage.age(5, 1, 4) == ("lineage", 0)
    assert lineage.age(3, 1, 4) == ("lineage", 0)
    assert lineage.age(7, 2, 4) == ("future", 0)  # a newer learner's epoch


def test_versions_before_the_first_known_epoch_are_its_past() -> None:
    """A checkpoint of an earlier build keeps no lineage: the learner knows only its step and version, and the
    pending groups of the steps lost since are trained again, aged backwards from there."""
    lineage = Lineage.from_json([[0, 50, 50]])
    assert lineage.age(49, None, 50) == (None, 1)
    assert lineage.age(48, None, 51) == (None, 3)
    assert lineage.age(49, 0, 50) == (None, 1)  # stamped with the same epoch


def test_the_table_round_trips_and_epochs_only_go_forward() -> None:
    lineage = crashed_once()
    assert Lineage.from_json(lineage.to_json()).epochs == lineage.epochs == [Epoch(0, 0, 0), Epoch(1, 3, 6)]
    assert Lineage.from_json(None).epochs == [Epoch(0, 0, 0)]
    with pytest.raises(ValueError):
        lineage.begin(1, 4, 20)  # the same epoch number again
    with pytest.raises(ValueError):
        lineage.begin(2, 4, 7)  # a version that is not above the one the current epoch gives that step


def test_groups_carry_an_optional_epoch_and_messages_without_one_still_decode() -> None:
    stamped = decode_group(encode_group(make_group(epoch=3)))
    assert stamped.epoch == 3
    plain = make_group()
    assert "epoch" not in msgpack.unpackb(encode_group(plain), raw=False)  # what earlier builds send
    assert decode_group(encode_group(plain)).epoch is None
    body = msgpack.unpackb(encode_group(make_group(epoch=3)), raw=False)
    body["epoch"] = -1
    with pytest.raises(SchemaError, match="epoch"):
        decode_group(msgpack.packb(body, use_bin_type=True))


def test_announcements_carry_the_epoch_and_an_older_hash_reads_as_epoch_0() -> None:
    ann = WeightsAnnouncement(6, "/w/v000006", "xxh3-128:" + "a" * 32, epoch=1)
    h = ann.to_hash()
    assert h["epoch"] == "1" and WeightsAnnouncement.from_hash(h) == ann
    older = {k: v for k, v in h.items() if k != "epoch"}
    assert WeightsAnnouncement.from_hash(older).epoch == 0
