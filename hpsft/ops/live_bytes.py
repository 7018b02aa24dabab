"""A count of the tensor memory a piece of code allocates, as CUDA's caching allocator counts it.

LiveBytes is a TorchDispatchMode: it sees every ATen call made while it is active (factory
functions, out= and in-place variants, the autograd engine's calls during backward) and
every tensor they return. A returned tensor whose storage is neither one of the call's
inputs (a view or an in-place result) nor already counted is a new allocation: its bytes,
rounded up to the allocator's 512-byte blocks (what torch.cuda.max_memory_allocated adds
up), count from then until Python's last reference to the storage goes. Storages that
existed before the mode started are not counted, not even when they are freed inside it:
`peak` is the peak of the memory allocated inside, which is what a benchmark's
`max_memory_allocated() - memory_allocated()` before the measured step reads.

It works on any device, and its purpose is the meta device: tensors with shapes and dtypes
and no data, so that the allocations of a GPU-sized step can be replayed on a CPU machine in
milliseconds (hpsft/ops/byte_accounting.py).
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CUDA_BLOCK_BYTES = 512  # the caching allocator's smallest block: every allocation is a multiple of it


def allocator_bytes(nbytes: int) -> int:
    """The bytes CUDA's caching allocator counts for a request of `nbytes` (0 stays 0)."""
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


class LiveBytes(TorchDispatchMode):
    """`live`: bytes allocated inside the mode and still referenced; `peak`: their maximum;
    `at_peak`: (shape, dtype, bytes) of every tensor alive at the peak, largest first."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.at_peak: list[tuple[tuple[int, ...], torch.dtype, int]] = []
        self._storages: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}  # storage id -> what it holds

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and _storage_key(tensor) not in inputs:
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = _storage_key(tensor)
        if key in self._storages:
            return
        nbytes = allocator_bytes(storage.nbytes())
        self._storages[key] = (tuple(tensor.shape), tensor.dtype, nbytes)
        self.live += nbytes
        # The storage's Python object lives exactly as long as the storage (torch preserves it).
        weakref.finalize(storage, self._release, key)
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = sorted(self._storages.values(), key=lambda entry: -entry[2])

    def _release(self, key: int) -> None:
        self.live -= self._storages.pop(key)[2]


def _storage_key(tensor: torch.Tensor) -> int:
    # The StorageImpl's address: unique while it lives (a meta storage has no data pointer).
    return tensor.untyped_storage()._cdata
