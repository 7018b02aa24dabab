"""LoRA (PEFT) runs: only the adapters train and are checkpointed, a resume continues the
run exactly, and both exports (merged model, adapter alone) compute the trained model; under
ZeRO-3 with 2 ranks (gloo, CPU), where the base model is built partitioned."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, base_overrides, read_metrics, run_cli
from tests.test_export import folder_weights
from tests.test_spmd_training import assert_ok, rel_diff

CHECK_SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_lora_and_check.py")
LOGIT_RTOL = 1e-5  # fp32: merged W + s*B@A vs the adapter's separate path; measured ~6e-7


def lora_overrides(model_path, train, val, out_dir, **extra) -> list[str]:
    # 4 sequences per step, 2 per rank; peak FLOPs given: no start-up GEMM measurement.
    return base_overrides(model_path, train, val, out_dir, **{
        "model.lora.rank": 4, "model.lora.alpha": 8, "engine.zero_stage": 3, "data.train_batch_size": 4,
        "data.micro_batch_size_per_gpu": 2, "trainer.total_steps": 4, "trainer.save_every": 2,
        "trainer.peak_flops_per_device": 1e12, **extra})


@pytest.mark.slow
def test_lora_under_zero3_trains_only_adapters_resumes_exactly_and_exports(tmp_path, model_path, tiny_data):
    out = tmp_path / "run"
    assert_ok(run_cli(None, lora_overrides(model_path, *tiny_data, out), nproc=2, script=CHECK_SCRIPT))
    check = json.loads((out / "lora_check.json").read_text())
    print(f"\nlogits: merged vs adapter {check['merged_vs_adapter']:.1e}, engine vs adapter "
          f"{check['engine_vs_adapter']:.1e}, base vs adapter {check['base_vs_adapter']:.1e}")

    # Only the adapters (A and B of the 7 linear layers of each of the 2 layers) require
    # gradients; every one of them moved, and no base weight changed by a single bit.
    assert check["trainable"] == check["adapters"] and len(check["adapters"]) == 2 * 7 * 2
    assert all(".lora_A." in name or ".lora_B." in name for name in check["adapters"])
    assert check["adapters_unchanged"] == []
    assert check["base_compared"] > 0 and check["base_changed"] == []
    # The merged hf/ folder and the base model with hf/adapter loaded by PEFT compute the
    # trained engine's logits; training moved them away from the base model's.
    assert check["merged_vs_adapter"] < LOGIT_RTOL and check["engine_vs_adapter"] < LOGIT_RTOL
    assert check["base_vs_adapter"] > 1e-3

    # A checkpoint holds the adapters and their optimizer state, not the base model.
    checkpoint = out / "checkpoints" / "global_step_2"
    checkpoint_bytes = sum(p.stat().st_size for p in checkpoint.iterdir())
    model_bytes = (Path(model_path) / "model.safetensors").stat().st_size
    print(f"checkpoint {checkpoint_bytes / 2**20:.2f} MiB, model {model_bytes / 2**20:.1f} MiB")
    assert checkpoint_bytes < model_bytes / 20

    # Resumed mid-way (2 ranks again), the run continues as the uninterrupted one did.
    resumed = tmp_path / "resumed"
    proc = run_cli("hpsft.train", lora_overrides(model_path, *tiny_data, resumed, **{
        "trainer.resume": checkpoint, "trainer.export_hf": "false"}), nproc=2)
    assert_ok(proc)
    assert f"resumed from {checkpoint} at step 2" in proc.stdout
    straight = {m["step"]: m for m in read_metrics(out)}
    again = {m["step"]: m for m in read_metrics(resumed)}
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert again[step]["train/tokens"] == straight[step]["train/tokens"]
        assert rel_diff(again[step]["train/loss"], straight[step]["train/loss"]) <= 1e-6, step

    # Other LoRA settings make another run: its checkpoint is refused, naming them.
    proc = run_cli("hpsft.train", lora_overrides(model_path, *tiny_data, tmp_path / "other", **{
        "trainer.resume": checkpoint, "model.lora.rank": 8}))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "model.lora: {rank: 4, alpha: 8.0, dropout: 0.0, target_modules: [all-linear]} -> {rank: 8," in proc.stderr

    # `hpsft export` of the final checkpoint, in one process: merged, it is the end of run's
    # hf/ bit for bit (base weights read from the model folder); alone, the adapter is hf/adapter's.
    assert_ok(run_cli("hpsft.cli", ["export", str(out), str(tmp_path / "merged")]))
    assert_ok(run_cli("hpsft.cli", ["export", str(out), str(tmp_path / "adapter"), "--adapter-only"]))
    merged, final = folder_weights(tmp_path / "merged"), folder_weights(out / "hf")
    assert merged.keys() == final.keys() == load_file(Path(model_path) / "model.safetensors").keys()
    assert all(torch.equal(merged[name], final[name]) for name in final)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    end_of_run = load_file(out / "hf" / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == end_of_run.keys() and len(adapter) == len(check["adapters"])
    assert all(torch.equal(adapter[name], end_of_run[name]) for name in adapter)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
