"""`hpsft train` on image rows through the CLI, at one process, DP=2 (ZeRO-2, ZeRO-3) and SP=2
(ZeRO-2, ZeRO-3), on the mixed layout of tests/test_image_data_stage.py (docs/vision.md). Its own
file: pytest-xdist deals whole files to its workers, and these runs are the longest of the vision
tests."""

from pathlib import Path

import pytest

from tests.test_image_data_stage import (assert_exported_as_at_the_end, image_data, mixed_layout_data,  # noqa: F401
                                         parameters_of, ranks_with_images, step_figures, tiny_vl_folder,
                                         vl_overrides, vl_tokenizer)


@pytest.mark.slow
def test_training_on_image_rows_at_dp2_and_sp2_equal_one_process_and_exports(
        image_data, tmp_path, vl_tokenizer):
    """`hpsft train` on image rows with a tiny Qwen2-VL folder, 3 steps of 4 sequences laid out so
    that at DP=2 rank 0's micro-batch has images and rank 1's none (steps 1 and 2) and then
    neither has (step 3): 2 ranks under ZeRO-2 and under ZeRO-3 (the folder's saved
    names mapped by transformers' renamings) give each step's loss and unclipped grad norm of one
    process (fp32, <= 1e-5 relative), and so do 2 ranks as DP=1 x SP=2 (engine.sequence_parallel_size=2:
    each packed row cut in two) under ZeRO-2 and under ZeRO-3. The end-of-run export's image processor
    (its preprocessor_config.json, copied from the model folder) has the folder's settings. (A
    frozen tower: tests/test_frozen_tower_zero3.py.) `hpsft export` of the DP=2 ZeRO-2 run's last checkpoint equals
    that run's end-of-run hf/ in every tensor (bit for bit), loads with AutoModelForImageTextToText,
    and carries the same processor and tokenizer files. Every run's subprocess has a 300 s timeout: a hang fails, it does not block.
    Measured: see docs/vision.md. Planted bugs:
    - PackedVisionLM's blank image for an imageless row removed (as on main before it) -> the DP=2
      ZeRO-2 run aborted in step 1's backward: gloo "op.preamble.length <= op.nbytes. 991688 vs
      979448. Received data size doesn't match expected size";
    - SourcedDataset.__getitem__ dropping the store items' images -> the one-process run failed
      (ValueError "sequence 0 has 24 image placeholder tokens, which are not the tokens of whole
      images 0.. of the row (tokens per image [])"; seen with the earlier 18-row layout);
    - the worker's export not given the model folder (no processor files copied) -> OSError
      from AutoImageProcessor on the exported hf/ (no preprocessor_config.json)."""
    from tests.conftest import assert_ok, rel_diff, run_cli

    data = mixed_layout_data(image_data)
    model = tiny_vl_folder(tmp_path / "model", vl_tokenizer)
    assert ranks_with_images(data, tmp_path / "layout", vl_tokenizer, model) == [[True, False], [True, False],
                                                                                 [False, False]]
    runs = {"one": (1, {}), "zero2": (2, {"trainer.export_hf": "true"}), "zero3": (2, {"engine.zero_stage": 3}),
            "sp2": (2, {"engine.sequence_parallel_size": 2}),
            "sp2_zero3": (2, {"engine.sequence_parallel_size": 2, "engine.zero_stage": 3})}
    for name, (nproc, extra) in runs.items():
        assert_ok(run_cli("hpsft.train", vl_overrides(model, data, tmp_path / name,
                                                      **{"engine.zero_stage": 2, **extra}), nproc=nproc, timeout=300))
    reference = step_figures(tmp_path / "one")
    compared = ("zero2", "zero3", "sp2", "sp2_zero3")
    print("one process", reference, *(f"\n{name} {step_figures(tmp_path / name)}" for name in compared))
    assert len(reference) == 3
    for name in compared:
        for (loss, norm), (ref_loss, ref_norm) in zip(step_figures(tmp_path / name), reference, strict=True):
            assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(norm, ref_norm) <= 1e-5, \
                (name, loss, norm, ref_loss, ref_norm)
    # The export carries the folder's image processor (AutoProcessor itself needs torchvision, absent here).
    from transformers import AutoImageProcessor

    exported = AutoImageProcessor.from_pretrained(tmp_path / "zero2" / "hf").to_dict()
    assert exported == AutoImageProcessor.from_pretrained(model).to_dict(), exported
    # `hpsft export` of a DP=2 run's last checkpoint (ZeRO-2 shards) is its end-of-run export, every tensor.
    assert_exported_as_at_the_end(tmp_path / "zero2", tmp_path / "zero2_exported")
    assert set(parameters_of(tmp_path / "zero2_exported")) == set(parameters_of(Path(model)))  # transformers loads it
    for name in ("preprocessor_config.json", "tokenizer_config.json"):
        assert (tmp_path / "zero2_exported" / name).read_bytes() == (tmp_path / "zero2" / "hf" / name).read_bytes(), name
