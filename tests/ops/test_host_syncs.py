"""Finding the supervised rows reads the device's data back as little as it can: the one
nonzero (the rows' count depends on the data) and one read-back each for the offsets' and the
labels' checks, no .item() per check (each is a wait for the device on a GPU). The read-backs
are .tolist() calls, which a dispatch mode does not see on CPU: what is checked here is that
no .item() is left and that nonzero runs once."""

import pytest
import torch

from hpsft.ops import varlen_targets
from tests.syncing_ops import DataDependentOps

V = 50


def batch():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 0, 1, 9, 4]
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    input_ids = torch.randint(0, V, (total,), generator=g)
    loss_mask = torch.rand(total, generator=g) < 0.7
    return input_ids, loss_mask, offsets, total


def loop_positions(input_ids, loss_mask, offsets):
    """(position, label, sequence) of every row that predicts a supervised token, by sequence."""
    rows = []
    for s, (start, stop) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        rows += [(t, int(input_ids[t + 1]), s) for t in range(start, stop - 1) if loss_mask[t + 1]]
    return rows


@pytest.mark.parametrize("api", ["input_ids", "labels"])
def test_supervised_rows_with_one_nonzero_and_no_item(api):
    """The rows, labels and sequences equal a loop over sequences. Planted: the per-check
    .item() calls of before fail the record (both APIs)."""
    input_ids, loss_mask, offsets, total = batch()
    expected = loop_positions(input_ids, loss_mask, offsets)
    labels = torch.full((total,), -100)
    for t, label, _ in expected:
        labels[t] = label
    with DataDependentOps() as ops:
        if api == "input_ids":
            found = varlen_targets.from_input_ids(input_ids, loss_mask, offsets, total, V)
        else:
            found = varlen_targets.from_labels(labels, -100, offsets, total, V)
    assert ops.seen == ["aten.nonzero.default"], ops.seen
    assert list(zip(found.positions.tolist(), found.labels.tolist(), found.sequence_ids.tolist())) == expected
    assert found.num_sequences == 5
