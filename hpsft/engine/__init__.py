"""Training engines: the contract (base.py), the factory that picks one by engine.name
(factory.py), one package per engine (deepspeed/: DeepSpeed ZeRO), and what engines share:
the optimizer and LR schedule (optimizer.py) and the gradient norm without ZeRO (grad_norm.py)."""

from hpsft.engine.base import EngineStep, TrainEngine
from hpsft.engine.factory import build_engine, checkpoint_weights, engine_class

__all__ = ["EngineStep", "TrainEngine", "build_engine", "checkpoint_weights", "engine_class"]
