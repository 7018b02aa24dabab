"""Image rows on the Ray path (docs/vision.md, docs/ray.md): the driver's data stage prepares them
as Ray tasks into the store one local process prepares, and 2 Ray workers train them as one SPMD
process does. One Ray instance (tests/test_ray.py's fixture), one Ray training run: they are dear.
The driver's split of a step == the SPMD sampler's is tested without Ray workers
(test_vision_cost.py)."""

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok, cli_command, ray_env, rel_diff, run_cli
from tests.test_image_data_stage import (image_data, mixed_layout_data, step_figures, tiny_vl_folder,  # noqa: F401
                                         vl_overrides, vl_tokenizer)
from tests.test_ray import RAY_WORKERS, ray_address  # noqa: F401

pytest.importorskip("ray")


def store_dir(cache: Path) -> Path:
    """The one store folder prepared in a data.cache_dir."""
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    return folder


@pytest.mark.slow
def test_image_rows_prepared_by_ray_tasks_and_trained_by_two_workers_equal_one_process(
        image_data, tmp_path, vl_tokenizer, ray_address):  # noqa: F811
    """`hpsft.train_ray` with 2 workers (ZeRO-2) on the tiny Qwen2-VL folder and the 12 image rows of
    the mixed layout (test_image_data_stage.MIXED_LAYOUT: in steps 1 and 2 one rank's micro-batch has
    images, the other's none), data.shard_mb set for 4 shards: the driver's RayTaskRunner prepares
    the shards as Ray tasks, its store's shard files (Arrow tokens and loss mask, patches, index)
    are byte-identical to the one-process run's local preparation; every step's loss and unclipped
    grad norm == one SPMD process (1e-5 relative). Each run's subprocess has a 300 s timeout.
    Measured and planted: docs/testing.md."""
    data = mixed_layout_data(image_data)
    model = tiny_vl_folder(tmp_path / "model", vl_tokenizer)
    shards = {"engine.zero_stage": 2, "data.shard_mb": data.stat().st_size / 4 / 2**20}
    one = run_cli("hpsft.train", vl_overrides(model, data, tmp_path / "one", **shards,
                                              **{"data.cache_dir": tmp_path / "local_cache"}), timeout=300)
    assert_ok(one)
    on_ray = subprocess.run(
        cli_command("hpsft.train_ray", vl_overrides(model, data, tmp_path / "ray", **shards, **RAY_WORKERS, **{
            "data.cache_dir": tmp_path / "ray_cache", "ray.address": ray_address})),
        cwd=REPO, env=ray_env(), capture_output=True, text=True, timeout=300)
    assert_ok(on_ray)
    local, by_tasks = store_dir(tmp_path / "local_cache"), store_dir(tmp_path / "ray_cache")
    assert by_tasks.name == local.name
    files = sorted(p.name for p in local.glob("shard-*") if not p.name.endswith(".json"))
    assert len(files) >= 12, files  # >= 4 shards x (arrow, patches, index)
    assert sorted(p.name for p in by_tasks.glob("shard-*") if not p.name.endswith(".json")) == files
    for name in files:
        assert (by_tasks / name).read_bytes() == (local / name).read_bytes(), name
    reference, ours = step_figures(tmp_path / "one"), step_figures(tmp_path / "ray")
    print("one process", reference, "\nray", ours)
    assert len(reference) == 3
    for (loss, norm), (ref_loss, ref_norm) in zip(ours, reference, strict=True):
        assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(norm, ref_norm) <= 1e-5, (loss, norm, ref_loss, ref_norm)
