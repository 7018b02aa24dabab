"""The worked configs users start from (configs/*.yaml) load with every key valid, and each
says in its header how it is run."""

from pathlib import Path

import pytest

from hpsft.config.load import load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_there_are_worked_configs_for_lora_zero3_long_context_and_mixtures():
    assert {p.stem for p in CONFIGS} >= {"sft", "lora", "multi_gpu_bf16_zero3", "long_context_sp", "mixture"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_worked_config_loads_and_names_its_command(path):
    """Catches a key renamed in the schema but not in the configs (planted: `lora.rank` ->
    `lora.r` in configs/lora.yaml: ConfigError naming model.lora.r)."""
    config = load_config(path)
    assert config.trainer.output_dir
    header = path.read_text().split("\nmodel:")[0]
    assert f"configs/{path.name}" in header or path.stem == "sft", f"{path}: its header shows no command running it"
