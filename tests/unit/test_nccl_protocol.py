"""The pure pieces of weights over NCCL (common/weights/nccl.py): bucket plans, SGLang's flattened-bucket layout, the
round's wire form, rank offsets; and the request bodies of the update-group calls against the fields SGLang's own
request structs declare (read from the installed wheel's source, where it is installed)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from common.weights.nccl import Bucket, NcclRound, assign_ranks, flatten, plan_buckets, unflatten


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(4, 3, generator=g)),  # 48 bytes
        ("b.weight", torch.randn(10, generator=g).to(torch.bfloat16)),  # 20 bytes
        ("c.weight", torch.randn(2, 2, 2, generator=g).to(torch.float16)),  # 16 bytes
        ("d.steps", torch.arange(5)),  # int64, 40 bytes
    ]


def test_buckets_keep_order_respect_the_size_and_hold_a_larger_tensor_alone() -> None:
    named = tensors()
    buckets = plan_buckets(named, 64)
    assert [b.names for b in buckets] == [["a.weight"], ["b.weight", "c.weight"], ["d.steps"]]
    assert [b.nbytes for b in buckets] == [48, 36, 40]
    assert buckets[1].dtypes == ["bfloat16", "float16"] and buckets[1].shapes == [[10], [2, 2, 2]]
    assert [b.names for b in plan_buckets(named, 1)] == [[n] for n, _ in named]  # each larger than the bound
    # int64 after 84 bytes would be unaligned (SGLang views each tensor at its offset): it starts a bucket
    assert [b.names for b in plan_buckets(named, 10**9)] == [["a.weight", "b.weight", "c.weight"], ["d.steps"]]
    with pytest.raises(ValueError, match="complex64"):
        plan_buckets([("z", torch.zeros(2, dtype=torch.complex64))], 64)


def test_a_flattened_bucket_reads_back_bit_for_bit() -> None:
    named = tensors()
    named[0] = ("a.weight", named[0][1].t())  # not contiguous: sent as its contiguous copy
    for bucket in plan_buckets(named, 64):
        by_name = dict(named)
        flat = flatten([by_name[n] for n in bucket.names])
        assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes
        for name, t in unflatten(flat, bucket).items():
            assert t.dtype == by_name[name].dtype and torch.equal(t, by_name[name])
    with pytest.raises(ValueError, match="holds"):
        unflatten(torch.zeros(7, dtype=torch.uint8), Bucket(["x"], ["float32"], [[1]]))


def test_rounds_travel_as_json_and_ranks_follow_the_learner() -> None:
    offsets, world = assign_ranks({"b": 2, "a": 1, "c": 1})
    assert offsets == {"a": 1, "b": 2, "c": 4} and world == 5  # the learner is rank 0; b has two TP ranks
    rnd = NcclRound("s1", 3, 7, "grpo-x-1", "10.0.0.1", 29500, world, "nccl", offsets, plan_buckets(tensors(), 64))
    assert rnd.id == "s1:3"
    assert NcclRound.from_json(rnd.to_json()) == rnd


def test_a_member_takes_only_the_announcement_of_its_own_round() -> None:
    """What a member received is served once weights:latest announces exactly its round: the version, over NCCL, with
    the uri naming the round (its learner's session and sequence number); a successor's announcement of the same
    version number, from disk or from its own round, is not it."""
    from actor.weights.nccl import announces
    from common.schemas import WeightsAnnouncement
    from common.weights.nccl import announcement_uri

    rnd = NcclRound("s1", 3, 7, "grpo-x-s1-1", "10.0.0.1", 29500, 2, "nccl", {"a": 1})
    digest = "xxh3-128:" + "0" * 32
    ours = WeightsAnnouncement(7, announcement_uri(rnd), digest, format="nccl")
    assert ours.uri == "nccl://10.0.0.1/grpo-x-s1-1/s1:3" and announces(ours, rnd)
    successor = NcclRound("s2", 1, 7, "grpo-x-s2-1", "10.0.0.1", 29501, 2, "nccl", {"a": 1})
    assert not announces(WeightsAnnouncement(7, announcement_uri(successor), digest, format="nccl"), rnd)
    assert not announces(WeightsAnnouncement(7, "/weights/v000007", digest), rnd)
    assert not announces(WeightsAnnouncement(8, announcement_uri(rnd), digest, format="nccl"), rnd)
    later = NcclRound("s1", 4, 7, "grpo-x-s1-1", "10.0.0.1", 29500, 2, "nccl", {"a": 1})  # (never: one round a version)
    assert not announces(WeightsAnnouncement(7, announcement_uri(later), digest, format="nccl"), rnd)
    assert not announces(None, rnd)


def _sglang_file(*parts: str) -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the sglang wheel is not installed (scripts/venv.sh installs it with the dev extra)")
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def test_flattened_buckets_match_sglangs_own_layout() -> None:
    """SGLang's FlattenedTensorBucket (sglang/srt/weight_sync/tensor_bucket.py needs only torch), loaded by path."""
    path = _sglang_file("srt", "weight_sync", "tensor_bucket.py")
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    named = dict(tensors())
    for bucket in plan_buckets(named.items(), 10**9):
        ours = flatten([named[n] for n in bucket.names])
        theirs = module.FlattenedTensorBucket(named_tensors=[(n, named[n]) for n in bucket.names])
        assert torch.equal(theirs.get_flattened_tensor(), ours)
        received = module.FlattenedTensorBucket.empty(bucket.names, bucket.dtypes, bucket.shapes, "cpu")
        received.get_flattened_tensor().copy_(ours)
        for name, t in received.reconstruct_tensors():
            assert torch.equal(t, named[name])


def _fields(source: str, cls: str) -> tuple[set[str], set[str]]:
    """All fields and the required ones (no default) of a class in SGLang's io_struct.py."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fields = {s.target.id: s.value is None for s in node.body if isinstance(s, ast.AnnAssign)}  # type: ignore[union-attr]
    return set(fields), {f for f, required in fields.items() if required}


def test_update_group_requests_carry_the_fields_sglang_declares() -> None:
    from actor.engines.sglang.engine import SGLangEngine
    from actor.engines.sglang.unannounced import Unannounced

    source = _sglang_file("srt", "managers", "io_struct.py").read_text()
    sent: list[tuple[str, dict[str, Any]]] = []

    class Recorder:
        def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
            sent.append((path, body))
            return {"success": True, "message": ""}

    engine = SGLangEngine.__new__(SGLangEngine)  # the request bodies only: no server, no tokenizer
    engine.client = Recorder()  # type: ignore[assignment]
    engine.unannounced = Unannounced(5.0)
    rnd = NcclRound("s", 1, 4, "g", "127.0.0.1", 1234, 2, "gloo", {"me": 1}, plan_buckets(tensors(), 64))
    engine.join_group(rnd, 1, 5.0)
    engine.receive(rnd, 5.0)
    assert engine.version == -1  # the server holds them, unannounced: nothing is sampled with them yet
    engine.commit(rnd)  # the round's announcement read
    engine.leave_group("g")
    structs = {
        "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
        "/begin_weight_update": "BeginWeightUpdateReqInput",
        "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
        "/end_weight_update": "EndWeightUpdateReqInput",
        "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    }
    paths = [p for p, _ in sent]
    assert paths == ["/init_weights_update_group", "/begin_weight_update", *["/update_weights_from_distributed"] * 3,
                     "/end_weight_update", "/destroy_weights_update_group"]  # fmt: skip
    for path, body in sent:
        fields, required = _fields(source, structs[path])
        assert set(body) <= fields, (path, set(body) - fields)
        assert required <= set(body), (path, required - set(body))
    updates = [b for p, b in sent if p == "/update_weights_from_distributed"]
    assert [b["flush_cache"] for b in updates] == [False, False, True]  # one flush, with the last bucket
    assert [b.get("weight_version") for b in updates] == [None, None, "4"]
    assert {b["load_format"] for b in updates} == {"flattened_bucket"} and engine.version == 4


def test_a_snapshot_holds_the_model_once_and_falls_back_to_disk_whole(tiny_model_dir: Path, tmp_path: Path) -> None:
    from common.model.loading import load_pretrained
    from common.weights import load_state_dict, publish
    from learner.nccl_weights import snapshot

    tok, model = load_pretrained(str(tiny_model_dir), "float32", "cpu")
    snap = snapshot(model, None, "bfloat16", 4096)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert [n for b in snap.buckets for n in b.names] == [n for n in state if n not in tied]
    assert snap.nbytes == sum(state[n].numel() * 2 for n in state if n not in tied)  # bfloat16: 2 bytes each
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # training goes on: the snapshot is a copy
    pub = publish(model, tok, tmp_path, 1, keep=2, dtype="bfloat16", state_dict=snap.tensors())
    written, _ = load_state_dict(pub.announcement)
    assert set(written) == set(snap.tensors())  # nothing taken for a tied weight and dropped
    for name, t in snap.tensors().items():
        assert torch.equal(written[name], t) and torch.equal(t, state[name].to(torch.bfloat16)), name


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (Linux's /proc/net/tcp and tcp6, state 0A), as hex."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(address)
    return found


def test_the_learners_rendezvous_listens_on_its_address_alone() -> None:
    """weights.nccl_address 127.0.0.1: the update group's store takes connections from this machine only (torch's
    own store listens on every interface)."""
    from common.ports import free_port
    from common.weights.nccl import close_group, open_group

    port = free_port()
    pg = open_group(address="127.0.0.1", port=port, world_size=1, rank=0, group_name="bind-test", backend="gloo",
                    timeout_s=10)  # fmt: skip
    try:
        assert _listeners(port) == ["0100007F"]  # 127.0.0.1, little-endian hex; not 0.0.0.0 nor ::
    finally:
        close_group(pg)
