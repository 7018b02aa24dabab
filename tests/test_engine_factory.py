"""The engine factory (engine.name -> engine class), the contract the worker keeps to with its
engine (TrainEngine), and the one the trainers keep to with their worker (Worker)."""

import ast
import importlib.util
import inspect

import pytest

from hpsft.config import load_config
from hpsft.engine import TrainEngine, build_engine
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.utils.distributed import Mesh
from hpsft.utils.errors import UserInputError
from hpsft.workers import TrainingWorker, Worker
from tests.conftest import REPO


def test_an_unknown_engine_name_is_refused_naming_the_known_ones():
    """Planted: engine_class returning ENGINES.get(name) (None, then a TypeError when called) fails it."""
    config = load_config(None, ["engine.name=fsdp2"])
    with pytest.raises(UserInputError) as refused:
        build_engine(config.engine, config.optim, total_steps=10, mesh=Mesh(dp_size=1))
    assert str(refused.value) == "engine.name='fsdp2' is not an engine hpsft has: use one of deepspeed, megatron"


def test_the_default_engine_is_deepspeed():
    config = load_config(None, [])
    assert config.engine.name == "deepspeed"
    assert type(build_engine(config.engine, config.optim, total_steps=10, mesh=Mesh(dp_size=1))) is DeepSpeedEngine


def members_used(path, holder: str) -> set[str]:
    """Every `self.<holder>.<member>` in the file at `path`."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == holder
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
    used = members_used(REPO / "hpsft" / "workers" / "training_worker.py", "engine")
    assert used == TrainEngine.__abstractmethods__ - {"__init__", "checkpoint_weights"}


def test_the_trainers_call_exactly_what_the_worker_contract_declares_and_both_workers_have_it():
    """SFTTrainer and RaySFTTrainer reach their worker only through Worker's members, Worker declares
    none they do not call, and TrainingWorker and DataParallelWorker implement every one of them
    with (at least) the contract's parameters. Planted: the trainer's former `self.worker.set_loss_fn`
    (the non-finite-gradient hook's) and the Ray driver's former `self.worker.group.shutdown()`
    each fail it (`set_loss_fn`, `group` are no members of the contract), and so does
    DataParallelWorker without its export_hf (abstract: not implemented)."""
    trainers = REPO / "hpsft" / "trainer" / "sft_trainer.py", REPO / "hpsft" / "ray" / "ray_trainer.py"
    assert set().union(*(members_used(path, "worker") for path in trainers)) == Worker.__abstractmethods__
    workers = [TrainingWorker]
    if importlib.util.find_spec("ray") is not None:  # the [ray] extra
        from hpsft.ray.data_parallel import DataParallelWorker

        workers.append(DataParallelWorker)
    for cls in workers:
        assert issubclass(cls, Worker) and not cls.__abstractmethods__, cls
        for name in Worker.__abstractmethods__:
            declared = inspect.signature(getattr(Worker, name)).parameters
            implemented = inspect.signature(getattr(cls, name)).parameters
            assert list(declared) == [p for p in implemented if p in declared], (cls, name)
            assert all(p.default is not inspect.Parameter.empty for n, p in implemented.items() if n not in declared)
