"""learner.packing: rows laid end to end, each sequence with its own positions, and back."""

from __future__ import annotations

import torch

from learner.packing import bins, pack, positions, unpack


def test_bins_fill_first_fit_longest_first_within_capacity() -> None:
    lengths = [5, 3, 8, 2, 4, 1]
    plan = bins(lengths, 8)
    assert plan == [[2], [0, 1], [4, 3, 5]]
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in plan)
    assert bins([9, 2], 8) == [[0], [1]]  # longer than the capacity: alone


def test_pack_keeps_each_sequences_tokens_and_positions_and_unpack_inverts_it() -> None:
    lengths = torch.tensor([3, 5, 2, 1])
    ids = torch.zeros((4, 5), dtype=torch.long)
    for r, n in enumerate(lengths.tolist()):
        ids[r, :n] = torch.arange(1, n + 1) + 10 * r
    p = pack(ids, lengths, pad_id=-1)
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 15], [1, 2, 3, 21, 22], [31, -1, -1, -1, -1]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 0, 1, 2, 3]]
    assert positions(lengths.tolist()) == p.input_ids.numel() == 15
    back = unpack(p.input_ids.unsqueeze(-1).float(), p).squeeze(-1).long()
    real = torch.arange(5) < lengths.unsqueeze(1)
    assert torch.equal(back[real], ids[real])
    assert torch.equal(back[~real], torch.zeros_like(back[~real]))


def test_unpack_carries_gradients_to_the_packed_values() -> None:
    lengths = torch.tensor([2, 1, 1])
    p = pack(torch.ones((3, 2), dtype=torch.long), lengths, pad_id=0)
    values = torch.randn((*p.input_ids.shape, 4), requires_grad=True)
    unpack(values, p).sum().backward()
    assert values.grad is not None
    used = torch.zeros(p.input_ids.shape, dtype=torch.bool)
    used[p.at] = True
    assert torch.equal(values.grad[used], torch.ones((int(used.sum()), 4)))
    assert torch.equal(values.grad[~used], torch.zeros((int((~used).sum()), 4)))
