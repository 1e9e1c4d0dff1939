"""Packed rows (``learner.pack_sequences``): a forward's right-padded rows laid end to end in fewer rows, each no
longer than the longest of them, so that the linear layers see little padding when lengths are uneven.

Each sequence keeps its own positions (0, 1, ... from its first token) and attends only to itself: given
``position_ids`` and no attention mask, transformers finds where each sequence starts (a position that does not
follow the one before it) and builds the block-diagonal causal mask, or hands the sequences' bounds to a
flash-attention kernel, which skips the masked blocks. A row's logits are then those of its own forward, up to float
rounding. Pure: tensors in, tensors out; :class:`learner.trainer.Trainer` runs the model between :func:`pack` and
:func:`unpack`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """The rows (indices into ``lengths``) of each packed row: first fit, longest first, each within ``capacity``
    tokens (a row longer than it goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packed: list[list[int]] = []
    room: list[int] = []
    for i in order:
        slot = next((b for b, r in enumerate(room) if lengths[i] <= r), None)
        if slot is None:
            packed.append([i])
            room.append(capacity - lengths[i])
        else:
            packed[slot].append(i)
            room[slot] -= lengths[i]
    return packed


@dataclass(frozen=True)
class Packed:
    """The packed rows and where each real token of the original rows went."""

    input_ids: torch.Tensor  # (packed rows, capacity)
    position_ids: torch.Tensor  # each sequence counts from 0; a row's padded tail is a sequence of its own
    at: tuple[torch.Tensor, torch.Tensor]  # (packed row, column) of every real token...
    source: tuple[torch.Tensor, torch.Tensor]  # ...and its (row, column) in the original rows
    shape: tuple[int, int]  # the original rows' (rows, width)


def positions(lengths: list[int]) -> int:
    """The positions, real or padding, of one forward of rows of these lengths packed (the padding share's
    denominator): as many packed rows as :func:`bins` makes, each the longest row's length."""
    return len(bins(lengths, max(lengths))) * max(lengths)


def pack(ids: torch.Tensor, lengths: torch.Tensor, pad_id: int) -> Packed:
    """Pack the right-padded rows ``ids`` (rows, width), whose first ``lengths`` tokens are real, into rows of the
    longest row's length."""
    sizes = lengths.tolist()
    width = max(sizes)
    plan = bins(sizes, width)
    out = torch.full((len(plan), width), pad_id, dtype=ids.dtype, device=ids.device)
    positions = torch.zeros((len(plan), width), dtype=torch.long, device=ids.device)
    at_row: list[int] = []
    at_col: list[int] = []
    src_row: list[int] = []
    src_col: list[int] = []
    for p, members in enumerate(plan):
        start = 0
        for r in members:
            n = sizes[r]
            out[p, start : start + n] = ids[r, :n]
            positions[p, start : start + n] = torch.arange(n, device=ids.device)
            at_row += [p] * n
            at_col += range(start, start + n)
            src_row += [r] * n
            src_col += range(n)
            start += n
        positions[p, start:] = torch.arange(width - start, device=ids.device)  # the tail: a sequence of its own

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=ids.device)

    return Packed(
        out, positions, (index(at_row), index(at_col)), (index(src_row), index(src_col)), (ids.shape[0], ids.shape[1])
    )


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The packed forward's per-position ``values`` (packed rows, capacity, ...) back in the original rows' layout
    (rows, width, ...), zeros at their padding (which nothing downstream reads: the loss mask covers real tokens)."""
    out = values.new_zeros((*packed.shape, *values.shape[2:]))
    out[packed.source] = values[packed.at]
    return out
