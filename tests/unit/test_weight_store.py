"""common.weights: atomic, verified, pruned versions, what a reader may open, and the lease token they carry."""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from common.schemas import WeightsAnnouncement
from common.weights import WeightsError, digest, load_into, load_state_dict, publish, verify, version_dir


def test_publish_is_atomic_verified_and_pruned(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    root = tmp_path / "weights"
    pubs = [publish(model, tok, root, v, keep=2) for v in range(1, 5)]
    assert sorted(p.name for p in root.iterdir()) == ["v000003", "v000004"]  # only the newest two, no temp dirs
    ann = pubs[-1].announcement
    assert ann.uri == str(version_dir(root, 4)) and ann.digest == digest(ann.uri)[0]
    assert ann.digest_algorithm == "xxh3-128" and len(ann.digest) == len("xxh3-128:") + 32
    assert (Path(ann.uri) / "digest").read_text().strip() == ann.digest
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in Path(ann.uri).iterdir()}
    assert pubs[-1].nbytes > 1_000_000

    # A fresh model loads the published tensors exactly.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    state, _ = load_state_dict(ann)
    load_into(other, state)
    for (name, a), (_, b) in zip(
        other.state_dict().items(), AutoModelForCausalLM.from_pretrained(ann.uri).state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name

    # A corrupted or vanished version is refused.
    with pytest.raises(WeightsError, match="does not match"):
        load_state_dict(WeightsAnnouncement(4, ann.uri, "xxh3-128:" + "0" * 32))
    with pytest.raises(WeightsError, match="pruned"):
        load_state_dict(pubs[0].announcement)


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_a_changed_byte_is_caught_by_either_digest(tiny_model_dir: Path, tmp_path: Path, algorithm: str) -> None:
    import hashlib

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ann = publish(model, None, tmp_path / "w", 1, keep=2, digest_algorithm=algorithm).announcement
    weights = Path(ann.uri) / "model.safetensors"
    if algorithm == "sha256":  # the announced digest is the file's plain sha256, checkable with sha256sum
        assert ann.digest == "sha256:" + hashlib.sha256(weights.read_bytes()).hexdigest()
    state, nbytes = load_state_dict(ann)
    assert nbytes == weights.stat().st_size and set(state) >= {"model.embed_tokens.weight"}
    assert verify(ann) == nbytes
    # The mapping a loaded state views keeps its bytes when the version is pruned meanwhile.
    before = state["model.embed_tokens.weight"].clone()
    shutil.rmtree(ann.uri)
    assert torch.equal(state["model.embed_tokens.weight"], before)

    ann = publish(model, None, tmp_path / "w", 2, keep=2, digest_algorithm=algorithm).announcement
    weights = Path(ann.uri) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    for check in (load_state_dict, verify):
        with pytest.raises(WeightsError, match="does not match"):
            check(ann)
    weights.write_bytes(bytes(data[:1000]))  # truncated: not even a safetensors file any more
    with pytest.raises(WeightsError):
        load_state_dict(ann)


def test_publish_can_cast_to_the_serving_dtype(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    full = publish(model, None, tmp_path / "w", 1, keep=2)
    half = publish(model, None, tmp_path / "w", 2, keep=2, dtype="bfloat16")
    assert 0.45 < half.nbytes / full.nbytes < 0.55
    config = json.loads((Path(half.announcement.uri) / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    state, _ = load_state_dict(half.announcement)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    load_into(other, state)  # an engine in float32 takes them, rounded
    for (name, a), (_, b) in zip(other.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16).float()), name
    assert torch.equal(model.state_dict()["lm_head.weight"], model.state_dict()["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    "header",
    [
        b"[1, 2]",
        b'{"w": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}',
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1600]}}',
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}',
        b'{"w": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}}',
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0]}}',
        b"not json",
    ],
)
def test_a_corrupt_safetensors_header_is_a_weights_error(tmp_path: Path, header: bytes) -> None:
    import struct

    version = tmp_path / "v000001"
    version.mkdir()
    (version / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    ann = WeightsAnnouncement(1, str(version), digest(version)[0])  # the digest matches: the header is what is wrong
    with pytest.raises(WeightsError, match="not a safetensors file"):
        load_state_dict(ann)


MOUNTS = """overlay / overlay rw 0 0
server:/export /mnt/shared nfs4 rw 0 0
/dev/sda1 /mnt/shared/local ext4 rw 0 0
/dev/sdb1 /mnt/my\\040disk xfs rw 0 0
gcsfuse /mnt/bucket fuse.gcsfuse rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [("/mnt/shared/w/v000001", "nfs4"), ("/mnt/shared/local/w", "ext4"), ("/mnt/sharedx", "overlay"),
     ("/mnt/my disk/w", "xfs"), ("/mnt/bucket/w", "fuse.gcsfuse"), ("/etc", "overlay")],
)  # fmt: skip
def test_the_filesystem_under_a_path_decides_between_mapping_and_reading(path: str, kind: str) -> None:
    from common.weights import mount_type

    assert mount_type(path, MOUNTS) == kind


def test_weights_on_a_network_filesystem_are_read_not_mapped(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmap

    from transformers import AutoModelForCausalLM

    import common.weights.reading as weights

    ann = publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None, tmp_path / "w", 1, keep=2).announcement
    local, _ = load_state_dict(ann)
    monkeypatch.setattr(weights, "mount_type", lambda path, mounts=None: "nfs4")
    mapped: list[object] = []
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: mapped.append(a))
    remote, _ = load_state_dict(ann)
    assert not mapped and remote.keys() == local.keys()
    assert all(torch.equal(remote[k], local[k]) for k in local)
    assert digest(ann.uri)[0] == ann.digest


def test_mismatch_names_what_does_not_fit() -> None:
    from common.weights import TensorSpec, mismatch

    f32, bf16, i64 = torch.float32, torch.bfloat16, torch.int64
    served = {"a": TensorSpec(f32, (4, 2)), "b": TensorSpec(f32, (3,)), "n": TensorSpec(i64, (1,))}
    assert mismatch(served, served) is None
    # weights.dtype: a float32 engine takes bfloat16 tensors (the copy casts)
    assert mismatch(served, {**served, "a": TensorSpec(bf16, (4, 2))}) is None
    assert mismatch(served, {**served, "a": TensorSpec(f32, (4, 3))}) == "shapes a [4, 3] (served [4, 2])"
    assert mismatch(served, {**served, "a": TensorSpec(i64, (4, 2))}) == "dtypes a int64 [4, 2] (served float32 [4, 2])"
    assert mismatch(served, {**served, "n": TensorSpec(f32, (1,))}) == "dtypes n float32 [1] (served int64 [1])"
    partial = {"a": served["a"], "n": served["n"], "c": TensorSpec(f32, (1,))}
    assert mismatch(served, partial) == "missing ['b']; unknown ['c']"
    assert mismatch(served, {"a": served["a"], "n": served["n"]}, optional={"b"}) is None  # tied, left out


def test_tensor_specs_reads_headers_and_rejects_garbage(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from common.weights import TensorSpec, WeightsError, tensor_specs

    save_file({"w": torch.zeros(2, 5), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    assert tensor_specs(tmp_path) == {"w": TensorSpec(torch.float32, (2, 5)), "b": TensorSpec(torch.bfloat16, (5,))}
    (tmp_path / "z.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        tensor_specs(tmp_path)


# -- loads that fit all or nothing, from inside weights.dir only ---------------------------------------------------


def _engine(model_dir: Path, run_dir: Path):  # type: ignore[no-untyped-def]
    from actor.engines.local import LocalEngine
    from common.config import load_config

    return LocalEngine(load_config(None, [f"model.path={model_dir}", f"run.dir={run_dir}"]), seed=0)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _published(model_dir: Path, root: Path, version: int, change: float = 1.0) -> WeightsAnnouncement:
    """A version of the model with every floating-point tensor moved by ``change``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(change)
    return publish(model, None, root, version, keep=5).announcement


@pytest.mark.parametrize("fault", ["shape", "missing", "unknown", "dtype"])
def test_a_load_that_does_not_fit_changes_nothing(tiny_model_dir: Path, tmp_path: Path, fault: str) -> None:
    """Every other tensor fits (and differs): none of them may be copied before the misfit is found."""
    from safetensors.torch import load_file, save_file

    from common.weights import WeightsMismatch

    engine = _engine(tiny_model_dir, tmp_path)
    before = _snapshot(engine.model)
    good = _published(tiny_model_dir, tmp_path / "weights", 1)
    file = Path(good.uri) / "model.safetensors"
    state = load_file(str(file))
    name = "model.norm.weight"
    if fault == "shape":
        state[name] = torch.ones(state[name].numel() + 3)
    elif fault == "missing":
        del state[name]
    elif fault == "unknown":
        state["model.extra.weight"] = torch.ones(2)
    else:
        state[name] = torch.ones_like(state[name], dtype=torch.int64)
    save_file(state, str(file), metadata={"format": "pt"})
    bad = WeightsAnnouncement(2, good.uri, digest(good.uri)[0])  # a digest that matches: only the tensors are wrong
    with pytest.raises(WeightsMismatch, match="weights do not fit the model"):
        engine.load(bad)
    assert engine.version == 0
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.load(_published(tiny_model_dir, tmp_path / "weights", 3))  # and the engine still loads a good one
    assert engine.version == 3 and not torch.equal(engine.model.state_dict()[name], before[name])


def test_loads_are_confined_to_the_weights_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An announced uri outside weights.dir (absolute, through ../, through a symlink), or a file in a version that
    is a symlink, is refused before anything is read, and the engine keeps its weights and version."""
    from common.weights import UnsafeWeightsPath

    engine = _engine(tiny_model_dir, tmp_path / "run")
    root = Path(engine.cfg.weights.dir)
    before = _snapshot(engine.model)
    outside = _published(tiny_model_dir, tmp_path / "elsewhere", 7)  # a valid version with a valid digest
    (root / "v000008").mkdir(parents=True)
    (root / "v000008" / "model.safetensors").symlink_to(Path(outside.uri) / "model.safetensors")
    (root / "v000009").symlink_to(outside.uri)
    uris = {
        "absolute": outside.uri,
        "dotdot": str(root / ".." / ".." / "elsewhere" / "v000007"),
        "relative": os.path.relpath(outside.uri),
        "dir symlink": str(root / "v000009"),
        "file symlink": str(root / "v000008"),
        "the root itself": str(root),
    }
    for what, uri in uris.items():
        with pytest.raises(UnsafeWeightsPath, match="refused"):
            engine.load(WeightsAnnouncement(9, uri, outside.digest))
            pytest.fail(f"{what}: loaded")
        assert engine.version == 0, what
    assert all(torch.equal(before[k], engine.model.state_dict()[k]) for k in before)
    with pytest.raises(UnsafeWeightsPath):
        verify(WeightsAnnouncement(9, outside.uri, outside.digest), root=root)
    # A symlink that stays inside weights.dir is an ordinary name for a version there.
    inside = _published(tiny_model_dir, root, 10)
    (root / "latest").symlink_to(inside.uri)
    engine.load(WeightsAnnouncement(10, str(root / "latest"), inside.digest))
    assert engine.version == 10


def test_a_fifo_among_the_weights_is_refused_without_blocking(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer, forever: it must be refused, not opened."""
    from common.weights import UnsafeWeightsPath

    root = tmp_path / "run" / "weights"
    good = _published(tiny_model_dir, root, 1)
    version = root / "v000002"
    version.mkdir()
    fifo = version / "model.safetensors"
    os.mkfifo(fifo)
    ann = WeightsAnnouncement(2, str(version), good.digest)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_state_dict(ann, root=root)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # blocked in open(): a writer lets it go, so the test leaves nothing behind
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
        pytest.fail("the load blocked on a FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], UnsafeWeightsPath), outcome
    with pytest.raises(UnsafeWeightsPath):
        verify(ann, root=root)


# -- one writer; the pruner keeps what is announced --------------------------------------------------------------


def test_concurrent_publishes_all_succeed_and_the_announced_version_is_kept(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The learner's training loop and its NCCL fall-back thread both publish: many at once, every one succeeds
    (no prune deletes another's temporary copy), and each announced version exists when it is announced."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry
    from transformers import AutoModelForCausalLM

    from common.metrics import LearnerMetrics
    from common.weights import wait_pruned
    from learner.publishing import Publisher

    root = tmp_path / "weights"
    announced: list[int] = []

    def announce(ann: WeightsAnnouncement) -> None:
        assert Path(ann.uri).is_dir() and digest(ann.uri)[0] == ann.digest
        announced.append(ann.version)

    weights_cfg = SimpleNamespace(dir=str(root), keep=2, dtype="model", digest="xxh3-128")
    learner = SimpleNamespace(
        cfg=SimpleNamespace(weights=weights_cfg, checkpoint=SimpleNamespace(dir=str(tmp_path / "checkpoints"))),
        transport=SimpleNamespace(lease_token=lambda: 1),  # the learner's lease token, which its versions carry
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        tokenizer=None,
        _publish_lock=threading.Lock(),
        announced_version=-1,
        _announce=announce,
        base=None,  # whole weights (learner.lora off)
        metrics=LearnerMetrics(CollectorRegistry()),
    )
    versions = list(range(1, 41))
    random.Random(0).shuffle(versions)
    with ThreadPoolExecutor(max_workers=8) as pool:
        errors = [f.exception() for f in [pool.submit(Publisher._write, learner, v, None) for v in versions]]
    assert errors == [None] * len(versions)
    assert announced == sorted(announced) and announced[-1] == 40  # versions never went back
    wait_pruned(root)
    # Nothing half-written is left; the newest two stay, and the one announced before the last until the next.
    kept = {p.name for p in root.iterdir()}
    assert "v000040" in kept and kept <= {"v000039", "v000040", f"v{announced[-2]:06d}"}


def test_the_pruner_keeps_the_version_being_published_whatever_its_number(tiny_model_dir: Path, tmp_path: Path) -> None:
    """After Redis lost a run's keys a learner may resume below versions a lost learner left on disk: the version
    it publishes (and announces) must not be pruned as one of the oldest."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    root = tmp_path / "weights"
    for v in (10, 11, 12):
        publish(model, None, root, v, keep=2)
    pub = publish(model, None, root, 5, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["v000005", "v000011", "v000012"]
    state, _ = load_state_dict(pub.announcement)
    assert state
    publish(model, None, root, 6, keep=2, protect=[5])  # the announced one is kept until the next is announced
    assert sorted(p.name for p in root.iterdir()) == ["v000005", "v000006", "v000011", "v000012"]


def test_versions_carry_the_learners_token_and_a_superseded_one_never_counts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """learner.fencing: holder 1 published 1-3; holder 2 took the run over finding version 3 and published 4; holder 1,
    frozen meanwhile, woke and published 4 (refused: holder 2's) and 5 (written, never announced). Version 5 does not
    count as published, holder 2's prune removes it, and holder 1's prune never touches holder 2's versions."""
    from transformers import AutoModelForCausalLM

    from common.transport import LeaseLost
    from common.weights import newest_on_disk, prune, version_token

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    root = tmp_path / "weights"

    def superseded(token: int, version: int) -> bool:  # holder 2's marker: it found version 3
        return token < 2 and version > 3

    for v in (1, 2, 3):
        publish(model, None, root, v, keep=5, token=1)
    publish(model, None, root, 4, keep=5, token=2, superseded=superseded)
    assert version_token(root / "v000004") == 2
    with pytest.raises(LeaseLost, match="lease token 2"):
        publish(model, None, root, 4, keep=5, token=1, superseded=superseded)
    publish(model, None, root, 5, keep=1, token=1)  # holder 1 before it sees the marker: prunes only its own
    assert sorted(p.name for p in root.iterdir()) == ["v000004", "v000005"]
    assert newest_on_disk(root) == 5 and newest_on_disk(root, superseded) == 4
    prune(root, keep=1, token=2, superseded=superseded)
    assert sorted(p.name for p in root.iterdir()) == ["v000004"]


def test_the_pruner_removes_only_its_own_or_old_temporary_copies(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from common.weights import prune

    root = tmp_path / "weights"
    publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None, root, 1, keep=2)
    busy, stale = root / ".tmp-v000002-p1other-0a1b2c3d", root / ".tmp-v000003-p1other-4e5f6a7b"
    for d in (busy, stale):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    for p in (stale / "model.safetensors", stale):
        os.utime(p, (two_hours_ago, two_hours_ago))
    prune(root, keep=2)
    assert busy.exists() and not stale.exists()  # another publisher's copy in progress is left alone


def test_a_version_is_on_disk_before_its_name_is(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every file and the directory are synced before the rename, and the weights directory after it: after a
    power loss a renamed version is never a name over empty files."""
    from transformers import AutoModelForCausalLM

    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:  # type: ignore[no-untyped-def]
        events.append(("rename", str(src)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    root = (tmp_path / "weights").resolve()
    pub = publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None, root, 1, keep=2)
    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) == 1
    tmp = events[renames[0]][1]
    synced_before = {path for kind, path in events[: renames[0]] if kind == "fsync"}
    files = {str(Path(tmp) / p.name) for p in Path(pub.announcement.uri).iterdir()}
    assert files | {tmp} <= synced_before
    assert ("fsync", str(root)) in events[renames[0] :]
