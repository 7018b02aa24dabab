"""The fp32 weights a DeepSpeed checkpoint folder holds, read in one process (hpsft export),
whatever the number of ranks and the ZeRO stage that wrote it."""

from collections.abc import Mapping
from pathlib import Path

import torch

from hpsft.engine.deepspeed.layout import BF16_OPTIMIZER_STATES, Layout, UniversalState, model_states
from hpsft.engine.deepspeed.universal import to_universal


class UniversalWeights(Mapping):
    """The fp32 weights of a universal checkpoint folder, each read from its file when asked."""

    def __init__(self, folder: Path):
        self.state = UniversalState(folder)
        self.names = self.state.names()

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(name)
        return self.state.tensor(name, "fp32")

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def fp32_weights(folder: Path, scratch: Path) -> Mapping[str, torch.Tensor] | None:
    """The folder's fp32 weights by name, each read (or reassembled from ZeRO's shards) when
    asked; None when `folder` holds no DeepSpeed checkpoint. With tensor parallelism the TP
    slices are merged into a universal folder under `scratch` first."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    layout = Layout.of(folder)
    if layout is None:
        return None
    if layout.universal:
        return UniversalWeights(folder)
    if layout.tp_size > 1 or any(folder.glob(BF16_OPTIMIZER_STATES)):
        # AutoTP: one model file per TP rank (zero_to_fp32 would read the first TP rank's slices
        # as whole weights). DeepSpeed's universal conversion merges each parameter's slices by
        # the row/column/replicated patterns AutoTP recorded in the checkpoint (and the vocabulary
        # rows of engine.vocab_parallel_head: checkpoint.record_vocabulary_shards), onto disk.
        # BF16_Optimizer's files lack the ZeRO stage zero_to_fp32 reads them by ("is not a zero
        # checkpoint"); the universal conversion reads their fp32 partitions.
        to_universal(folder, scratch / "universal")
        return UniversalWeights(scratch / "universal")
    if layout.zero_shards or layout.zero3:
        return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name, lazy_mode=True)
    # Written without ZeRO (one process runs ZeRO-1/2 so): its model file holds them whole.
    # DeepSpeed's file holds pickled objects beside the tensors (docs/checkpoints.md: a
    # checkpoint is code, as with the ZeRO path above).
    module = torch.load(folder / model_states(0), map_location="cpu", mmap=True, weights_only=False)["module"]
    return {name: tensor.float() for name, tensor in module.items()}
