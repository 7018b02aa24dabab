"""The engine a run trains with, by its name (engine.name): a second engine is one more
entry here and a file of its own, nothing in the worker."""

from hpsft.engine.base import TrainEngine
from hpsft.engine.deepspeed_engine import DeepSpeedEngine
from hpsft.utils.errors import UserInputError

ENGINES: dict[str, type[TrainEngine]] = {"deepspeed": DeepSpeedEngine}


def engine_class(name: str) -> type[TrainEngine]:
    if name not in ENGINES:
        raise UserInputError(f"engine.name={name!r} is not an engine hpsft has: use one of "
                             f"{', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def build_engine(engine_config, optim_config, total_steps: int) -> TrainEngine:
    """The engine engine_config.name names, for a run of `total_steps` optimizer steps."""
    return engine_class(engine_config.name)(engine_config, optim_config, total_steps)
