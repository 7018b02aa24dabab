"""Load a config: schema defaults <- YAML file <- `key=value` overrides, then freeze."""

from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from hpsft.config.schema import SFTConfig
from hpsft.utils.errors import UserInputError
from hpsft.config.secrets import is_secret_key, mask_secrets


class ConfigError(UserInputError):
    """A bad config: the message names the key and what is allowed."""


def _valid_keys(node, key_path: str) -> list[str]:
    parent = node
    for part in key_path.split(".")[:-1]:
        parent = parent.get(part) if hasattr(parent, "get") else None
        if parent is None:
            return sorted(node.keys())
    return sorted(parent.keys()) if hasattr(parent, "keys") else []


def _explain(err: OmegaConfBaseException, schema) -> str:
    key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError):
        if is_secret_key(key):  # e.g. trainer.wandb.api_key: a credential has no config key at all
            return (f"config key '{key}' would hold a credential: hpsft takes credentials from the environment "
                    "only (WANDB_API_KEY, HF_TOKEN, ...) and never from the config, which it writes to the run "
                    "directory and the trackers; remove the key and export the variable instead")
        return f"unknown config key '{key}'; valid keys here: {', '.join(_valid_keys(schema, key))}"
    return f"bad value for config key '{key}': {str(err).splitlines()[0]}"


def load_config(config_file: str | Path | None = None, overrides: list[str] = ()) -> SFTConfig:
    schema = OmegaConf.structured(SFTConfig)
    try:
        merged = schema
        if config_file is not None:
            path = Path(config_file)
            if not path.is_file():
                raise ConfigError(f"config file {path} does not exist")
            try:
                loaded = OmegaConf.load(path)
            except yaml.YAMLError as err:
                raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(err).split())}") from None
            if not isinstance(loaded, DictConfig):
                raise ConfigError(f"config file {path} must hold sections (model:, data:, ...), not a list")
            merged = OmegaConf.merge(merged, loaded)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(err, schema)) from None
    except ValueError as err:  # raised by the dataclasses' own checks
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from None
    return config


def masked_dict(config: SFTConfig) -> dict:
    """The config as nested dicts with its secrets masked (hpsft/config/secrets.py): what the trackers get."""
    return mask_secrets(OmegaConf.to_container(OmegaConf.structured(config)))


def to_yaml(config: SFTConfig) -> str:
    """The masked config as YAML: what config.yaml holds."""
    return OmegaConf.to_yaml(OmegaConf.create(masked_dict(config)))
