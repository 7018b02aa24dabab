import pytest

from hpsft.config import ConfigError, load_config, to_yaml
from hpsft.config.schema import SFTConfig
from tests.conftest import REPO


def test_defaults_overrides_and_yaml_file(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("optim:\n  lr: 0.5\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(cfg_file, ["optim.lr=3e-4", "data.train_files=[a.parquet,b.jsonl]"])
    assert isinstance(cfg, SFTConfig)
    assert cfg.optim.lr == 3e-4  # the command line wins over the file
    assert cfg.trainer.total_steps == 7
    assert cfg.data.train_files == ["a.parquet", "b.jsonl"]
    assert cfg.trainer.output_dir == "runs/default"
    assert load_config(None, []) == SFTConfig()
    # The resolved YAML round-trips to the same config.
    (tmp_path / "resolved.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception, match="cannot assign"):
        cfg.optim.lr = 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; valid keys here: betas, eps, grad_clip, lr"),
        ("foo.bar=1", "unknown config key 'foo'; valid keys here: data, engine, loss, model, optim, ray, trainer"),
        ("trainer.total_steps=abc", "bad value for config key 'trainer.total_steps'"),
        ("engine.zero_stage=5", "engine.zero_stage=5 is not one of [0, 1, 2, 3]"),
        ("data.truncation=middle", "data.truncation='middle' is not one of ['error', 'left', 'right', 'split', 'turns']"),
        ("data.multiturn=last", "data.multiturn='last' is not one of ['auto', 'per_turn', 'whole']"),
        ("engine.offload_params=true", "engine.offload_params needs engine.zero_stage=3"),
        ("engine.dtype=bfloat16 engine.zero_stage=0", "engine.dtype=bfloat16 needs engine.zero_stage >= 1"),
        ("optim", "override 'optim' is not of the form key=value"),
        ("trainer.overwrite_output_dir=true", "trainer.overwrite_output_dir=true needs trainer.resume=disable"),
        ("trainer.keep_last_checkpoints=-1", "trainer.keep_last_checkpoints must be >= 0, got -1"),
        ("trainer.max_skipped_steps=0", "trainer.max_skipped_steps must be > 0, got 0"),
        ("model.lora.rank=-4", "model.lora.rank must be >= 0, got -4"),
        ("model.lora.alpha=0", "model.lora.alpha must be > 0, got 0.0"),
        ("model.lora.dropout=1.0", "model.lora.dropout must be in [0, 1), got 1.0"),
        ("model.lora.target_modules=[]", "model.lora.target_modules is empty"),
        ("model.lora.target_modules=[all-linear,q_proj]", "all-linear already names every linear layer"),
        ("model.lora.r=8", "unknown config key 'model.lora.r'; valid keys here: alpha, double_quant, dropout, quantize_base, "
                           "rank, target_modules, use_dora"),
        ("model.lora.use_dora=true", "model.lora.use_dora=true needs model.lora.rank > 0"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split())
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_validation_files_come_only_with_their_data():
    # Overriding the training data must not keep validating on the demo's split.
    assert load_config(None, ["data.train_files=[mine.parquet]"]).data.val_files == []
    demo = load_config(REPO / "configs" / "sft.yaml")
    assert demo.data.train_files == [".cache/data/chatterbot/train.parquet"]
    assert demo.data.val_files == [".cache/data/chatterbot/val.parquet"]
