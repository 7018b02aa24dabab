"""A dataset class of the user's (data.custom_cls: a .py file and a class name in it).

The interface the trainer needs (docs/data.md, "A dataset class of your own"):
- `__init__(data_files, tokenizer, config)`: `data_files` a list of one path (one entry of
  data.train_files or data.val_files: a class is built once per entry), `tokenizer` the
  model's Hugging Face tokenizer (with data.chat_template applied), `config` the data section
  (hpsft.config.DataConfig);
- `__len__()`: the number of examples;
- `__getitem__(i)`: `{"input_ids": 1-D integer tensor, "loss_mask": 1-D bool or 0/1 tensor of
  the same length}`, as the built-in SFTDataset returns (other keys are ignored); a token is
  a loss target when its loss_mask is set (the first token of a sequence never is).
Each example is checked as it is read (hpsft/data/sources.py). Loading the file runs it: it is
the user's own code, like the config (docs/security.md).
"""

import importlib.util
import inspect
from pathlib import Path

import torch

from hpsft.utils.errors import UserInputError

INTERFACE = ("a custom dataset class needs __init__(self, data_files, tokenizer, config), __len__(self) and "
             "__getitem__(self, i) -> {'input_ids', 'loss_mask'} (docs/data.md)")
REQUIRED_METHODS = ("__len__", "__getitem__")


def defines(cls: type, method: str) -> bool:
    """Whether the class or a base of its own defines `method`: torch's Dataset base defines
    a __getitem__ that only raises NotImplementedError, which does not count."""
    return any(method in vars(base) for base in cls.__mro__ if base not in (object, torch.utils.data.Dataset))


def load_custom_class(path: str, name: str) -> type:
    """The class `name` of the Python file `path`, checked against the interface."""
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise UserInputError(f"data.custom_cls.path={path!r} is not an existing .py file")
    spec = importlib.util.spec_from_file_location(f"hpsft_custom_dataset_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, name, None)
    if not inspect.isclass(cls):
        raise UserInputError(f"data.custom_cls: {file} defines no class {name!r}" + (
            f" ({name} is a {type(cls).__name__})" if cls is not None else "") + f"; {INTERFACE}")
    for method in REQUIRED_METHODS:
        if not defines(cls, method):
            raise UserInputError(f"data.custom_cls: class {name} in {file} has no {method} method; {INTERFACE}")
    try:
        inspect.signature(cls).bind(data_files=[], tokenizer=None, config=None)
    except TypeError:
        raise UserInputError(f"data.custom_cls: class {name} in {file} cannot be built as {name}(data_files=..., "
                             f"tokenizer=..., config=...) (its signature: {inspect.signature(cls)}); "
                             f"{INTERFACE}") from None
    return cls
