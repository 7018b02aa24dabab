"""Training engines: the contract (base.py), the factory that picks one by engine.name
(factory.py) and the DeepSpeed ZeRO implementation (deepspeed_engine.py, with its optimizer,
gradient norm and checkpoint layout conversion in optimizer.py, grad_norm.py, universal.py)."""

from hpsft.engine.base import TrainEngine
from hpsft.engine.deepspeed_engine import DeepSpeedEngine
from hpsft.engine.factory import build_engine, engine_class

__all__ = ["DeepSpeedEngine", "TrainEngine", "build_engine", "engine_class"]
