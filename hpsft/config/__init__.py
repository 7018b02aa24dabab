"""Typed configuration: YAML + dotted overrides -> frozen dataclasses. Imports nothing of hpsft."""

from hpsft.config.load import ConfigError, load_config, masked_dict, to_yaml
from hpsft.config.schema import (
    DataConfig,
    EngineConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RayConfig,
    SFTConfig,
    TrainerConfig,
    WandbConfig,
)

__all__ = [
    "ConfigError", "load_config", "masked_dict", "to_yaml",
    "DataConfig", "EngineConfig", "LoraConfig", "LossConfig", "ModelConfig", "OptimConfig", "RayConfig", "SFTConfig", "TrainerConfig",
    "WandbConfig",
]
