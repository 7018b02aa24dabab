"""hpsft: a high-performance supervised fine-tuning trainer on DeepSpeed ZeRO."""

__version__ = "0.1.0"
