"""The engine factory (engine.name -> engine class) and the contract the worker keeps to."""

import ast

import pytest

from hpsft.config import load_config
from hpsft.engine import TrainEngine, build_engine
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.utils.distributed import Mesh
from hpsft.utils.errors import UserInputError
from tests.conftest import REPO


def test_an_unknown_engine_name_is_refused_naming_the_known_ones():
    """Planted: engine_class returning ENGINES.get(name) (None, then a TypeError when called) fails it."""
    config = load_config(None, ["engine.name=fsdp2"])
    with pytest.raises(UserInputError) as refused:
        build_engine(config.engine, config.optim, total_steps=10, mesh=Mesh(dp_size=1))
    assert str(refused.value) == "engine.name='fsdp2' is not an engine hpsft has: use one of deepspeed"


def test_the_default_engine_is_deepspeed():
    config = load_config(None, [])
    assert config.engine.name == "deepspeed"
    assert type(build_engine(config.engine, config.optim, total_steps=10, mesh=Mesh(dp_size=1))) is DeepSpeedEngine


def engine_members_used(path) -> set[str]:
    """Every `self.engine.<member>` in the file at `path`."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
            used.add(node.attr)
    return used


def test_the_worker_uses_exactly_what_the_engine_contract_declares():
    """The worker reaches the engine only through TrainEngine's members, and TrainEngine declares
    none the worker does not use (its constructor and checkpoint_weights are the factory's:
    build_engine, and hpsft export's checkpoint_weights). Planted: the test hook's former
    `self.engine.engine.global_steps` fails it (`engine` is no member of the contract), and so
    do a `dp_group` declared again in TrainEngine and the worker's former `self.engine.module.lm`
    (`module` left the contract: the worker keeps the model it built)."""
    used = engine_members_used(REPO / "hpsft" / "workers" / "training_worker.py")
    assert used == TrainEngine.__abstractmethods__ - {"__init__", "checkpoint_weights"}
