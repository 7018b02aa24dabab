"""A dispatch-level record of the ATen calls that need the device's data on the host (on a
GPU each is a wait for the device): nonzero, .item(), masked_select, boolean-mask indexing."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
               torch.ops.aten.masked_select.default}
INDEXING_OPS = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default}


class DataDependentOps(TorchDispatchMode):
    """`seen`: the name of every such call made while the mode is active."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in INDEXING_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if func in SYNCING_OPS or bool_index:
            self.seen.append(str(func))
        return func(*args, **kwargs)
