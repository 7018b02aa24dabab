"""The SPMD trainer: config -> dataset -> engine -> dataloader -> checkpoints -> fit."""

from hpsft.trainer.sft_trainer import SFTTrainer

__all__ = ["SFTTrainer"]
