"""The weights a learner publishes and its actors load, in modules behind this face: the store on the shared volume
(common.weights.store: write, prune), a version read back against its digest (common.weights.reading: digest,
verify, load), what a reader may open and its errors (common.weights.files), the safetensors format read without the
library (common.weights.format), LoRA adapters as a version's files (common.weights.adapters: imported from there),
and what the learner and its actors agree on for weights over NCCL (common.weights.nccl; imported from there, it
needs torch.distributed). Import the others' names from here."""

from __future__ import annotations

from common.weights.files import UnsafeWeightsPath, WeightsError, WeightsMismatch, confined, open_regular
from common.weights.format import TensorSpec, check_fits, load_into, mismatch, specs_of, tensor_specs
from common.weights.reading import digest, load_state_dict, mount_type, tensors_digest, verify
from common.weights.store import (
    LEASE_TOKEN_FILE,
    Published,
    Superseded,
    newest_on_disk,
    prune,
    publish,
    version_dir,
    version_token,
    wait_pruned,
)

__all__ = [
    "LEASE_TOKEN_FILE",
    "Published",
    "Superseded",
    "TensorSpec",
    "UnsafeWeightsPath",
    "WeightsError",
    "WeightsMismatch",
    "check_fits",
    "confined",
    "digest",
    "load_into",
    "load_state_dict",
    "mismatch",
    "mount_type",
    "newest_on_disk",
    "open_regular",
    "prune",
    "publish",
    "specs_of",
    "tensor_specs",
    "tensors_digest",
    "verify",
    "version_dir",
    "version_token",
    "wait_pruned",
]
