"""The vision tower's cost in the rank balance (hpsft/models/vision_cost.py, docs/vision.md): the
formula from the config == torch's own count of the tiny towers' matmuls, and a step's image-heavy
and text-only sequences are split over the ranks by tokens plus that cost, by the SPMD sampler and
by the Ray driver alike."""

import numpy as np
import pytest
import torch

from hpsft.data.balance import SequenceCost
from hpsft.data.batch import collate_jagged, image_grids
from hpsft.data.preparation import LocalRunner, prepared_store
from hpsft.data.sampler import StepBatchSampler
from hpsft.data.sources import SourcedDataset
from hpsft.models.vision_cost import VisionTowerCost
from hpsft.ray.data_parallel import DataParallelWorker
from hpsft.utils.distributed import Mesh
from tests.test_data_stage import options
from tests.conftest import write_jsonl
from tests.test_image_data_stage import image_data, image_processor, image_rows, tiny_model, vl_tokenizer  # noqa: F401
from tests.test_vision_lm import LLAVA_IMAGE


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_the_towers_flops_equal_torchs_count_of_its_matmuls(vl_tokenizer, family):
    """VisionTowerCost.image_flops == torch.utils.flop_counter.FlopCounterMode's count of the tiny
    tower's forward (get_image_features: patch embedding, layers, projector) on one image of each
    of three grids (6 x 8, 10 x 14: Qwen2.5-VL's windows of 4 x 4 patches with a remainder, 4 x 4),
    within 1e-6 relative (measured: equal). The tower runs eager attention: FlopCounterMode counts no
    FLOPs for CPU sdpa (it left out exactly the attention term, 4h per token per attended token)."""
    from torch.utils.flop_counter import FlopCounterMode

    lm = tiny_model(family, vl_tokenizer)
    lm.set_attn_implementation({"text_config": "eager", "vision_config": "eager"})
    cost = VisionTowerCost(lm.config)
    for grid in ([1, 6, 8], [1, 10, 14], [1, 4, 4]):
        if family == "llava":  # every image has the tower's size
            inputs = {"pixel_values": torch.randn(1, 3, LLAVA_IMAGE, LLAVA_IMAGE)}
        else:
            inputs = {"pixel_values": torch.randn(int(np.prod(grid)), 3 * 2 * 14 * 14),
                      "image_grid_thw": torch.tensor([grid])}
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            lm.model.get_image_features(**inputs)
        counted = counter.get_total_flops()
        assert abs(cost.image_flops(grid) - counted) <= 1e-6 * counted, (grid, cost.image_flops(grid), counted)


def test_the_rank_balance_counts_the_towers_work(image_data, tmp_path, vl_tokenizer):  # noqa: F811
    """A step of 4 sequences, a one-image chat (53 tokens with its 12 image tokens; the tiny Qwen2-VL's
    tower does 31.6 decoder tokens of work on its photograph) and three text-only ones of 90, 80 and
    60 tokens, split over 2 ranks by StepBatchSampler: by tokens alone the image chat goes with the
    90-token one (143 tokens against 140, but 174.6 counting the tower); with VisionTowerCost it goes
    with the 80-token one and the heavier rank carries 164.6 (measured). The Ray driver's split of
    the loaded step (DataParallelWorker.shard over 2 data-parallel ranks, no workers) == the
    sampler's. Planted: the driver weighing tokens alone (its SequenceCost's tower dropped) -> its
    split [[0, 1], [2, 3]] against the sampler's [[1, 3], [0, 2]]."""
    rows = image_rows(1) + [{"messages": [{"role": "user", "content": f"Say hello {n} times."},
                                          {"role": "assistant", "content": "hello " * n}]} for n in (50, 40, 20)]
    data = write_jsonl(rows, image_data.parent / "balance.jsonl")  # beside the photographs
    store = prepared_store(data, vl_tokenizer, options(), tmp_path / "cache", LocalRunner(1),
                           processor=image_processor())
    dataset = SourcedDataset([store], ["train"], 1024, "built-in dataset")
    cost = VisionTowerCost(tiny_model("qwen2_vl", vl_tokenizer).config)
    batch = list(range(4))
    tokens = dataset.sequence_lengths(batch).astype(np.float64)
    tower = np.array([cost.sequence_cost(grids) for grids in dataset.image_grids(batch)])
    assert tower[0] > 0 and (tower[1:] == 0).all(), tower

    def split(tower_cost) -> list[list[int]]:
        return [next(iter(StepBatchSampler(dataset, None, 4, part, 2, False, 0, SequenceCost(tower_cost=tower_cost))))
                for part in (0, 1)]

    def heavier(parts) -> float:
        return max(sum(tokens[i] + tower[i] for i in part) for part in parts)

    by_tokens, with_tower = split(None), split(cost)
    print(f"tokens {tokens.tolist()} tower {tower.round(1).tolist()}: by tokens {by_tokens} (heavier "
          f"{heavier(by_tokens):.1f}), with the tower {with_tower} ({heavier(with_tower):.1f})")
    assert sorted(by_tokens[0] + by_tokens[1]) == sorted(with_tower[0] + with_tower[1]) == batch
    assert by_tokens != with_tower and heavier(with_tower) < heavier(by_tokens)
    driver = DataParallelWorker(None, Mesh(dp_size=2, rank=None), SequenceCost(tower_cost=cost))
    positions, _ = driver.shard(collate_jagged([dataset[i] for i in batch]))
    assert positions == with_tower, (positions, with_tower)


def test_the_ray_drivers_split_weighs_llavas_images_as_the_sampler_does(image_data, tmp_path, vl_tokenizer):  # noqa: F811
    """LLaVA's batches have no image_grid_thw: the driver counts a sequence's images by its
    pixel_values rows (batch.image_grids, one width-0 row per image, as the store's index gives
    them), so its split of the first 10 of the 18 image rows over 2 ranks == the sampler's, which
    differs from the split by tokens alone (the tiny tower adds 11.1 and 5.5 decoder tokens to the
    two- and one-image rows). Planted: batch.image_grids giving LLaVA's sequences no images (shape
    (0, 0)) -> failed, the grids' shapes against the store's (2, 0), (1, 0), (0, 0), ..."""
    from tests.test_image_data_stage import llava_images

    store = prepared_store(str(image_data), vl_tokenizer, options(), tmp_path / "cache", LocalRunner(1),
                           processor=llava_images(vl_tokenizer))
    dataset = SourcedDataset([store], ["train"], 1024, "built-in dataset")
    batch = list(range(10))
    loaded = collate_jagged([dataset[i] for i in batch])
    assert [g.shape for g in image_grids(loaded)] == [g.shape for g in dataset.image_grids(batch)]
    cost = SequenceCost(tower_cost=VisionTowerCost(tiny_model("llava", vl_tokenizer).config))
    by_sampler = [next(iter(StepBatchSampler(dataset, None, 10, part, 2, False, 0, cost))) for part in (0, 1)]
    by_tokens = [next(iter(StepBatchSampler(dataset, None, 10, part, 2, False, 0))) for part in (0, 1)]
    positions, _ = DataParallelWorker(None, Mesh(dp_size=2, rank=None), cost).shard(loaded)
    print("sampler", by_sampler, "driver", positions, "by tokens", by_tokens)
    assert positions == by_sampler != by_tokens
