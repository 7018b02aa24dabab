"""shifted_labels and target_mask against a per-sequence loop written here, and without any
operation whose result size depends on data (on a GPU each is a wait for the device: nonzero,
boolean-mask indexing, .item())."""

import torch

from hpsft.data.batch import IGNORE_INDEX, shifted_labels, target_mask
from tests.syncing_ops import DataDependentOps


def loop_labels(input_ids, loss_mask, lengths):
    """The definition, one sequence at a time: position t of a sequence predicts its token
    t+1 when that token is supervised."""
    labels, start = [], 0
    for n in lengths:
        for t in range(n):
            nxt = start + t + 1
            labels.append(int(input_ids[nxt]) if t + 1 < n and loss_mask[nxt] else IGNORE_INDEX)
        start += n
    return torch.tensor(labels, dtype=torch.int64)


def test_labels_equal_the_per_sequence_loop_and_need_no_device_data_on_the_host():
    """Empty and one-token sequences (first, middle, last), a supervised first token (never a
    target) and random masks. Planted: the first token of each sequence not cleared (fails the
    loop comparison); the old nonzero-based code (fails the recorded-ops check)."""
    g = torch.Generator().manual_seed(0)
    for lengths in ([0, 5, 1, 0, 7, 3, 0], [1], [4, 4], [0], [9, 0, 1]):
        total = sum(lengths)
        input_ids = torch.randint(3, 1000, (total,), generator=g)
        loss_mask = torch.rand(total, generator=g) < 0.6
        if total:
            loss_mask[0] = True  # a supervised first token: nothing predicts it
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        with DataDependentOps() as ops:
            labels = shifted_labels(input_ids, loss_mask, offsets)
            targets = target_mask(loss_mask.long(), offsets)
        assert ops.seen == [], ops.seen
        expected = loop_labels(input_ids, loss_mask, lengths)
        assert torch.equal(labels, expected), lengths
        # target_mask keeps the mask's dtype; its targets are what the labels predict.
        assert targets.dtype == torch.long
        if total > 1:
            assert torch.equal(targets[1:].bool(), expected[:-1] != IGNORE_INDEX)
        assert not targets[offsets[:-1][offsets[:-1] < total]].any()


def test_the_check_sees_a_syncing_op():
    """The counterpart: the recorder does see nonzero and boolean-mask indexing."""
    mask = torch.tensor([True, False, True])
    with DataDependentOps() as ops:
        torch.nonzero(mask)
        torch.arange(3)[mask]
    assert len(ops.seen) == 2, ops.seen
