"""What a CUDA run pins and prefetches (hpsft/data/device_feed.py), read on CPU: the decision
needs a device type, not a device. That prefetching changes neither the batches nor a resume is
tests/test_spmd_training.py's stop-and-resume run (its resumed half has loader workers on)."""

import pytest
import torch

from hpsft.config.schema import DataConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig
from hpsft.data.batch import collate_jagged, packed_row, select
from hpsft.data.chat_tokenize import tokenize_conversation
from hpsft.data.device_feed import PREFETCH_FACTOR, device_feed, loader_options
from hpsft.utils.distributed import Mesh
from hpsft.workers import TrainingWorker

PREFETCHING = {"num_workers": 1, "prefetch_factor": PREFETCH_FACTOR, "persistent_workers": True}


def test_a_cuda_run_pins_its_rows_and_prefetches_a_cpu_run_does_neither():
    """Planted: device_feed deciding by `device.type == "cpu"` reversed (CUDA unpinned, no
    workers) fails the first assert; loader_options ignoring the feed's minimum fails the second."""
    for device in ("cuda", torch.device("cuda", 3)):
        cuda = device_feed(device)
        assert cuda.pin_rows and cuda.min_loader_workers == 1
        assert loader_options(cuda, 0) == PREFETCHING
        assert loader_options(cuda, 4) == PREFETCHING | {"num_workers": 4}
    cpu = device_feed("cpu")
    assert not cpu.pin_rows
    assert loader_options(cpu, 0) == {"num_workers": 0}  # as before this change
    # data.num_workers=1 on CPU is the loader a CUDA run gets (the resume test runs it).
    assert loader_options(cpu, 1) == loader_options(device_feed("cuda"), 0)


@pytest.fixture(scope="module")
def worker_and_batch(tokenizer, chat_rows):
    data = DataConfig(train_files=["unused.parquet"], max_tokens_per_micro_batch=160, max_length=160)
    worker = TrainingWorker(ModelConfig(), LossConfig(), EngineConfig(), OptimConfig(), data, total_steps=1,
                            mesh=Mesh(dp_size=1))
    samples = []
    for index, messages in enumerate(chat_rows[:6]):
        input_ids, loss_mask = tokenize_conversation(tokenizer, messages)
        samples.append({"input_ids": torch.tensor(input_ids), "loss_mask": torch.tensor(loss_mask, dtype=torch.bool),
                        "index": index})
    return worker, collate_jagged(samples)


def test_the_worker_pins_the_rows_it_builds_on_cuda_and_hands_them_over_as_built_on_cpu(worker_and_batch):
    """The worker's feed as init_model sets it from the engine's device. On CUDA every row is
    pinned where it is built: here, without an accelerator, pinning is refused, which shows the
    rows go through pin_memory(). On CPU the rows are packed_row's own, unpinned.
    Planted: micro_batches returning the rows without pinned(): the CUDA case raises nothing."""
    worker, batch = worker_and_batch
    worker.feed = device_feed("cuda")
    with pytest.raises(RuntimeError, match="accelerator"):
        worker.micro_batches(batch)
    worker.feed = device_feed("cpu")
    rows, bins = worker.micro_batches(batch)
    assert len(bins) > 1 and sorted(i for b in bins for i in b) == list(range(6))
    for row, positions in zip(rows, bins):
        expected = packed_row(select(batch, positions))
        assert row.keys() == expected.keys()
        for key, value in row.items():
            if torch.is_tensor(value):
                assert torch.equal(value, expected[key]) and not value.is_pinned(), key
            else:
                assert value == expected[key], key
