"""Seeding and the random generators' state (Python's, NumPy's, torch's CPU generator), saved
in a checkpoint's trainer state and restored on resume. The same in an SPMD rank, a Ray
worker and the Ray driver."""

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Plain data (numbers, lists, a tensor), so a checkpoint loads with weights_only=True."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached_gaussian],
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
