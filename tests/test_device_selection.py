"""Which GPU a rank takes (hpsft/utils/distributed.py: cuda_device_index) under the ways launchers
hand out GPUs. The visible-device count is the launcher's doing, so it is set here by
replacing torch.cuda.device_count: the logic runs on machines without GPUs too."""

import pytest
import torch

from hpsft.utils.distributed import cuda_device_index


@pytest.mark.parametrize("local_rank, visible, expected", [
    (0, 8, 0), (5, 8, 5),  # --gpus-per-node=8 --ntasks-per-node=8, torchrun: all GPUs visible
    (5, 1, 0),  # srun --gpus-per-task=1, Ray: each rank sees only its own GPU
])
def test_a_rank_takes_its_local_rank_or_its_only_device(monkeypatch, local_rank, visible, expected):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert cuda_device_index() == expected


def test_more_ranks_than_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3 but this process sees 2 GPUs"):
        cuda_device_index()
