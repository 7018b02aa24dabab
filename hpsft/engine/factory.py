"""The engine a run trains with, by its name (engine.name): a second engine is its package
under hpsft/engine/ and one more entry here, nothing in the worker or the trainer."""

from collections.abc import Mapping
from pathlib import Path

from hpsft.engine.base import TrainEngine
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.engine.megatron.engine import MegatronEngine
from hpsft.utils.distributed import Mesh
from hpsft.utils.errors import UserInputError

# megatron-core is imported by the Megatron engine's methods, not by this import.
ENGINES: dict[str, type[TrainEngine]] = {"deepspeed": DeepSpeedEngine, "megatron": MegatronEngine}


def engine_class(name: str) -> type[TrainEngine]:
    if name not in ENGINES:
        raise UserInputError(f"engine.name={name!r} is not an engine hpsft has: use one of "
                             f"{', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def build_engine(engine_config, optim_config, total_steps: int, mesh: Mesh) -> TrainEngine:
    """The engine engine_config.name names, for a run of `total_steps` optimizer steps, on this
    rank of `mesh`."""
    return engine_class(engine_config.name)(engine_config, optim_config, total_steps, mesh)


def checkpoint_weights(folder: Path, scratch: Path) -> Mapping:
    """The fp32 weights of checkpoint folder `folder`, whichever engine wrote it (TrainEngine.checkpoint_weights)."""
    for engine in ENGINES.values():
        weights = engine.checkpoint_weights(folder, scratch)
        if weights is not None:
            return weights
    raise UserInputError(f"{folder}: not a checkpoint of any engine hpsft has ({', '.join(sorted(ENGINES))}): "
                         "none of their state files are there")
