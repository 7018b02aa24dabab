"""DeepSpeed ZeRO behind the TrainEngine contract: the train step (engine.py), its DeepSpeed
config (config.py), the LM head's gradient summed into BF16_Optimizer's fp32 one
(head_gradient.py), and checkpoints: DeepSpeed's files and what a folder holds (layout.py),
save and load from any layout (checkpoint.py) through DeepSpeed's universal form
(universal.py), the weights alone for export (weights.py)."""

from hpsft.engine.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
