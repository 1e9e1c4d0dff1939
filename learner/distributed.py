"""The learner on several processes: ``torchrun --nproc_per_node=N --no-python grpo learner ...``.

PyTorch's FSDP2 (``fully_shard``) shards the model and AdamW's state over the ranks: each decoder layer is one unit
(gathered for its forward and backward, freed after), the rest of the model the root unit. The ranks are one SPMD
program with one difference: rank 0 alone talks to Redis and writes files. It reads each batch and broadcasts the
groups (as their wire bytes, msgpack, never pickle) to the others; every rank then builds the same padded batch and
shuffles it with the same generator, and trains on its own slice of every micro-batch (learner.trainer). The loss's
divisors are the whole micro-batch's (the dapo token count, the rows of grpo), so the ranks' gradients add up to
one process's. Publishing and checkpoints gather the full state to rank 0 (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict``), which writes the same safetensors files a single process
writes: a checkpoint resumes on any number of ranks, including one. (torch.distributed.checkpoint's own format
pickles its metadata, which nothing in this project does; gathering costs rank 0 the full state in CPU memory.)

Backends: NCCL when ``model.device`` is CUDA (rank r on ``cuda:<LOCAL_RANK>``), gloo on CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import msgpack
import torch
import torch.distributed as dist

from common.weights import WeightsError

log = logging.getLogger("learner")


@dataclass
class Ranks:
    """This process's place among the learner's ranks."""

    rank: int
    world: int
    device: str

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str) -> Ranks | None:
        """The process group torchrun describes in the environment (WORLD_SIZE > 1), or None for one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        cuda = device.startswith("cuda")
        if cuda:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            # Followers wait in a broadcast while rank 0 waits for actors' groups, which may take long (actors
            # restarting, a Redis failover): the collectives' timeout must not end the run for that.
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=24))
        return cls(dist.get_rank(), dist.get_world_size(), device)

    # -- the model ----------------------------------------------------------------------------------------------

    def shard(self, model: Any) -> Any:
        """FSDP2 over the decoder layers and the root (the embeddings, final norm and head)."""
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers if layers is not None else []:
            fully_shard(layer)
        fully_shard(model)
        return model

    def full_model_state(self, model: Any) -> dict[str, torch.Tensor]:
        """Every parameter whole, on CPU, at rank 0 ({} elsewhere). A collective: every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state: Any = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # Gathered copies no longer share storage, so save_pretrained cannot see that tied weights are one tensor:
        # leave out the tied ones, as a single process's save does.
        return {k: v for k, v in cast(dict[str, torch.Tensor], state).items() if k not in tied_keys(model)}

    def full_optimizer_state(self, model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """AdamW's state whole at rank 0, in ``optimizer.state_dict()``'s own layout (parameters by index), so that
        it is saved as one process saves it. A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if not optimizer.state:
            # No update yet (every rank steps together, so all agree): torch would initialise the state with a
            # fake step to gather it, and a resumed AdamW would then start with a step count of 1 and zero moments.
            return optimizer.state_dict() if self.is_rank0 else {}
        sd: Any = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not self.is_rank0:
            return {}
        index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
        return {"state": {index[n]: s for n, s in sd["state"].items()}, "param_groups": groups}

    def load_full_state(
        self, model: Any, optimizer: torch.optim.Optimizer, model_state: dict[str, torch.Tensor], optim: dict[str, Any]
    ) -> None:
        """Whole tensors (as a single process saves them) into the sharded model and optimizer; every rank passes
        the same, read from the checkpoint."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        tied = tied_keys(model)
        result = set_model_state_dict(model, {k: v for k, v in model_state.items() if k not in tied}, options=options)
        missing, unexpected = set(result.missing_keys) - tied, set(result.unexpected_keys)
        if missing or unexpected:
            raise WeightsError(
                f"checkpoint does not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        if not optim["state"]:  # saved before any update: the hyperparameters alone, as one process loads them
            optimizer.load_state_dict(optim)
            return
        names = [name for name, _ in model.named_parameters()]
        by_name: Any = {
            "state": {names[int(i)]: s for i, s in optim["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in optim["param_groups"]],
        }
        set_optimizer_state_dict(model, optimizer, by_name, options=options)

    # -- messages and sums --------------------------------------------------------------------------------------

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's ``value`` (msgpack-able: numbers, strings, bytes, lists, maps) at every rank."""
        if self.is_rank0:
            data = msgpack.packb(value, use_bin_type=True)
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, 0)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if self.is_rank0
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        dist.broadcast(buf, 0)
        return value if self.is_rank0 else msgpack.unpackb(buf.cpu().numpy().tobytes(), raw=False)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return [float(v) for v in t.cpu()]

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def tied_keys(model: Any) -> set[str]:
    """Parameters that are another one (an output head tied to the input embeddings), as transformers names them:
    a map of tied name to source in recent versions, a list of names in older ones."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return set()
    return set(getattr(model, "_tied_weights_keys", None) or [])
