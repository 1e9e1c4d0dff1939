"""common.tasks (the addition split and the shared cursor) and common.weights (atomic, verified versions)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from common.schemas import WeightsAnnouncement
from common.tasks import addition_task
from common.weights import WeightsError, digest, load_into, load_state_dict, publish, verify, version_dir


def test_addition_split_is_disjoint_and_deterministic() -> None:
    a, b = addition_task(20, seed=1), addition_task(20, seed=1)
    assert [p.id for p in a.eval] == [p.id for p in b.eval]
    assert len(a.eval) == 20 and len(a.train) == 80
    assert not {p.prompt for p in a.eval} & {p.prompt for p in a.train}
    p = next(p for p in a.all if p.id == "add-7-8")
    assert (p.prompt, p.reference) == ("7+8=", "15")
    assert [p.id for p in addition_task(20, seed=2).eval] != [p.id for p in a.eval]


def test_cursor_positions_cover_each_pass_once_in_the_same_order_everywhere() -> None:
    a, b = addition_task(20, seed=0), addition_task(20, seed=0)
    first_pass = [a.at(i).id for i in range(80)]
    assert sorted(first_pass) == sorted(p.id for p in a.train)  # every training prompt once per pass
    assert [b.at(i).id for i in range(80)] == first_pass  # another replica agrees
    second = [a.at(i).id for i in range(80, 160)]
    assert sorted(second) == sorted(first_pass) and second != first_pass  # reshuffled each pass


def test_eval_size_is_validated() -> None:
    with pytest.raises(ValueError):
        addition_task(100)


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

    import common.weights as weights

    ann = publish(AutoModelForCausalLM.from_pretrained(tiny_model_dir), None, tmp_path / "w", 1, keep=2).announcement
    local, _ = load_state_dict(ann)
    monkeypatch.setattr(weights, "mount_type", lambda path, mounts=None: "nfs4")
    mapped: list[object] = []
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: mapped.append(a))
    remote, _ = load_state_dict(ann)
    assert not mapped and remote.keys() == local.keys()
    assert all(torch.equal(remote[k], local[k]) for k in local)
    assert digest(ann.uri)[0] == ann.digest


def test_shape_mismatch_names_what_does_not_fit() -> None:
    from common.weights import shape_mismatch

    served = {"a": [4, 2], "b": [3]}
    assert shape_mismatch(served, {"a": [4, 2], "b": [3]}) is None
    assert shape_mismatch(served, {"a": [4, 3], "b": [3]}) == "shapes a [4, 3] (served [4, 2])"
    assert shape_mismatch(served, {"a": [4, 2], "c": [1]}) == "missing ['b']; unknown ['c']"


def test_tensor_shapes_reads_headers_and_rejects_garbage(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from common.weights import WeightsError, tensor_shapes

    save_file({"w": torch.zeros(2, 5), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    assert tensor_shapes(tmp_path) == {"w": [2, 5], "b": [5]}
    (tmp_path / "z.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        tensor_shapes(tmp_path)
