"""learner.checkpoint on the tiny model: what reaches the disk before a checkpoint's rename, a damaged newest checkpoint
set aside for the one before it, and CUDA generator states restored in device order."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from common.config import load_config
from learner import checkpoint
from learner.checkpoint import Resumable
from learner.trainer import Trainer


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path) -> Trainer:
    from common.model.loading import load_pretrained

    _, model = load_pretrained(str(tiny_model_dir), "float32", "cpu")
    return Trainer(load_config(overrides=["sampling.group_size=4"], env={}), model, pad_id=0)


def save(t: Trainer, root: Path, step: int, keep: int = 5) -> Path:
    path = checkpoint.save(root, Resumable(step, step), t.model, t.optimizer, t.scheduler, t.generator, keep=keep)
    assert path is not None
    return path


def test_files_and_directories_are_synced_before_and_after_the_rename(
    trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups a checkpoint covers are deleted from Redis right after it is renamed into place: every file must be
    on disk before the rename, and the directory entry after it, or a power loss leaves a checkpoint of empty
    files."""
    events: list[tuple[str, str]] = []
    real_fsync, real_open, real_rename = os.fsync, os.open, os.rename
    names: dict[int, str] = {}

    def opened(path, flags, *a, **k):  # type: ignore[no-untyped-def]
        fd = real_open(path, flags, *a, **k)
        names[fd] = str(path)
        return fd

    def fsync(fd: int) -> None:
        events.append(("fsync", names.get(fd, "?")))
        real_fsync(fd)

    def rename(src, dst) -> None:  # type: ignore[no-untyped-def]
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    final = save(trainer, tmp_path, 1)
    monkeypatch.undo()

    renamed = events.index(("rename", str(final)))
    synced_before = {Path(p).name for kind, p in events[:renamed] if kind == "fsync"}
    files = {p.name for p in final.iterdir()}
    assert files >= {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"}
    assert files <= synced_before, f"not synced before the rename: {files - synced_before}"
    assert any(Path(p).name.startswith(".tmp-step-000001") for kind, p in events[:renamed] if kind == "fsync")
    assert ("fsync", str(tmp_path)) in events[renamed + 1 :]  # the rename itself


@pytest.mark.parametrize(
    ("damaged_file", "how"),
    [
        ("model.safetensors", "cut"),  # a disk that filled up while writing it
        ("optimizer.safetensors", "empty"),  # renamed before its contents reached the disk, then a power loss
        ("state.json", "cut"),
    ],
)
def test_a_damaged_newest_checkpoint_is_set_aside_for_the_one_before(
    trainer: Trainer, tmp_path: Path, caplog: pytest.LogCaptureFixture, damaged_file: str, how: str
) -> None:
    older = save(trainer, tmp_path, 3)
    newest = save(trainer, tmp_path, 6)
    f = newest / damaged_file
    f.write_bytes(b"" if how == "empty" else f.read_bytes()[: f.stat().st_size // 2])

    with caplog.at_level(logging.WARNING, logger="learner"):
        assert checkpoint.latest(tmp_path) == older
    assert [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()] == [
        caplog.records[-1].getMessage()
    ]  # one line
    assert "step-000006" in caplog.records[-1].getMessage() and damaged_file in caplog.records[-1].getMessage()
    # Kept for inspection, out of the way of pruning (keep=1 must not delete the one checkpoint that is whole).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000006.damaged"]
    r = checkpoint.load(older, trainer.model, trainer.optimizer, trainer.scheduler, trainer.generator)
    assert r.step == 3
    save(trainer, tmp_path, 4, keep=1)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000004"


def test_whole_checkpoints_are_not_damaged(trainer: Trainer, tmp_path: Path) -> None:
    path = save(trainer, tmp_path, 2)
    assert checkpoint.damage(path) is None
    assert checkpoint.latest(tmp_path) == path


def test_no_whole_checkpoint_means_a_fresh_start(trainer: Trainer, tmp_path: Path) -> None:
    path = save(trainer, tmp_path, 2)
    (path / "rng.safetensors").write_bytes(b"")
    assert checkpoint.latest(tmp_path) is None


def test_cuda_generator_states_come_back_in_device_order() -> None:
    """Saved as cuda.0 … cuda.11: in the names' string order cuda.10 and cuda.11 would come before cuda.2, and
    set_rng_state_all would give device 2 the state of device 10."""
    rng = {f"cuda.{i}": torch.tensor([i], dtype=torch.uint8) for i in range(12)}
    rng |= {"torch": torch.tensor([100], dtype=torch.uint8), "trainer": torch.tensor([101], dtype=torch.uint8)}
    order = [int(s.item()) for s in checkpoint.cuda_rng_states(dict(sorted(rng.items())))]
    assert order == list(range(12))


def test_checkpoints_a_learner_wrote_after_another_took_over_are_never_resumed_nor_kept(
    trainer: Trainer, tmp_path: Path
) -> None:
    """learner.fencing: holder 1 checkpointed steps 2 and 4; holder 2 took the run over from step 4 and wrote 6;
    holder 1, frozen meanwhile, woke up and wrote 6 and 8. Neither of holder 1's late ones is resumed from, the prune
    removes them and keeps the newest that count, and holder 1 can replace nothing of holder 2's."""
    from common.transport import LeaseLost
    from learner import fencing

    def save_as(token: int, step: int, keep: int = 5) -> Path | None:
        r = Resumable(step, step, lease_token=token)
        return checkpoint.save(tmp_path, r, t.model, t.optimizer, t.scheduler, t.generator, keep=keep)

    t = trainer
    save_as(1, 2), save_as(1, 4)
    fencing.write_marker(tmp_path, fencing.Marker(1, 0, -1))
    fencing.write_marker(tmp_path, fencing.Marker(2, 4, 4))
    assert fencing.floor(tmp_path) == 2
    save_as(2, 6)
    with pytest.raises(LeaseLost, match="lease token 2"):  # step 6 is holder 2's: holder 1 cannot replace it
        save_as(1, 6)
    assert checkpoint.load(tmp_path / "step-000006", t.model, t.optimizer, t.scheduler, t.generator).lease_token == 2
    save_as(1, 8, keep=2)  # holder 1's own prune removes it (written after holder 2 took over), and leaves holder 2's
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000004", "step-000006"]
    (tmp_path / "step-000008").mkdir()  # had it survived, it would still never be resumed from
    (tmp_path / "step-000008" / "state.json").write_text('{"lease_token": 1}')
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000006"
    save_as(2, 10, keep=2)  # holder 2's prune: holder 1's late one goes, the newest two that count stay
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000006", "step-000010"]
