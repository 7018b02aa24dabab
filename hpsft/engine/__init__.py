"""Training engines: the contract (base.py) and its DeepSpeed ZeRO implementation."""

from hpsft.engine.base import TrainEngine
from hpsft.engine.deepspeed_engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "TrainEngine"]
