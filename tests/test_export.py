"""Checkpoints the ecosystem can read: DeepSpeed's own zero_to_fp32 output loads into the
Hugging Face model strictly, and `python -m hpsft.export` turns any checkpoint into a
Hugging Face folder (2 ranks, gloo, CPU)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import base_overrides, run_cli


def assert_ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def folder_weights(folder) -> dict:
    """Every tensor of a Hugging Face folder, whether one file or shards with an index."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    weights = {}
    for file in files:
        weights.update(load_file(folder / file))
    return weights


def zero_to_fp32(checkpoint) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_to_fp32_loads_strictly_and_any_checkpoint_exports(tmp_path, model_path, tiny_data, zero_stage):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    proc = run_cli("hpsft.train", base_overrides(model_path, *tiny_data, out, **{
        "engine.zero_stage": zero_stage, "trainer.save_every": 1, "data.micro_batch_size_per_gpu": 2,
    }), nproc=2)
    assert_ok(proc)
    step_1, step_2 = out / "checkpoints" / "global_step_1", out / "checkpoints" / "global_step_2"

    # DeepSpeed's own recovery of the final checkpoint is the Hugging Face model's state dict.
    recovered = zero_to_fp32(step_2)
    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out / "hf"))
    lm.load_state_dict(recovered, strict=True)
    exported = folder_weights(out / "hf")
    assert exported.keys() <= recovered.keys() and "model.embed_tokens.weight" in exported
    for name, tensor in exported.items():
        assert torch.equal(tensor, recovered[name]), name

    # An earlier checkpoint, exported by the tool in one process: its weights, not the final ones.
    proc = run_cli("hpsft.export", [str(step_1), str(tmp_path / "step_1")])
    assert_ok(proc)
    at_step_1 = zero_to_fp32(step_1)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "step_1", dtype=torch.float32).state_dict()
    assert reloaded.keys() == at_step_1.keys()
    for name, tensor in at_step_1.items():
        assert torch.equal(reloaded[name], tensor), name
    assert not torch.equal(at_step_1["model.norm.weight"], recovered["model.norm.weight"])
    assert "<|im_start|>" in AutoTokenizer.from_pretrained(tmp_path / "step_1").chat_template

    # The run directory exports its newest checkpoint: the end-of-run export, tensor by tensor,
    # here in 1 MB shards with Hugging Face's index.
    proc = run_cli("hpsft.export", [str(out), str(tmp_path / "final"), "--max-shard-mb", "1"])
    assert_ok(proc)
    assert (tmp_path / "final" / "model.safetensors.index.json").is_file()
    sharded = folder_weights(tmp_path / "final")
    assert sharded.keys() == exported.keys()
    for name, tensor in exported.items():
        assert torch.equal(sharded[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).state_dict()
    for name, tensor in recovered.items():
        assert torch.equal(reloaded[name], tensor), name

    # A folder that is not empty is never written into.
    proc = run_cli("hpsft.export", [str(out), str(tmp_path / "final")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"hpsft: error: {tmp_path / 'final'} exists and is not an empty folder" in proc.stderr
