"""DeepSpeed's checkpoint files, named here and nowhere else, and what a checkpoint folder holds.

A DeepSpeed checkpoint folder (root/tag) holds, below ZeRO-3, one model file per TP rank
(`mp_rank_<tp>_model_states.pt`: the module, the LR scheduler, the step counters; without ZeRO
also the whole torch AdamW state) and, with ZeRO 1-2, one optimizer-state file per ZeRO rank and
TP rank (`[bf16_]zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt`). ZeRO-3 partitions the module
too: one model file per rank (`zero_pp_rank_<dp>_mp_rank_00_model_states.pt`) beside its
optimizer shards. DeepSpeed's universal form (ds_to_universal) keeps the model files and puts
each trained parameter's state in files of its own, `zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`,
with the optimizer's hyperparameters in `zero/optimizer_state.pt`. A module state never holds
a frozen parameter (checkpoint.py: the base weights of a LoRA run are read from model.path).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.checkpoint.constants import PARAM, PARAM_GROUPS

UNIVERSAL_STATE = "zero"  # the per-parameter folders of a universal checkpoint
UNIVERSAL_OPTIMIZER = "optimizer_state.pt"  # in UNIVERSAL_STATE: the optimizer's param_groups, its clipping
UNIVERSAL_MARKER = "latest_universal"  # ds_to_universal writes it beside its output (nothing reads it here)
UNIVERSAL_SUFFIX = ".universal"  # a folder converted for a resume: root/<tag>.universal
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's, per parameter in a universal folder
MODEL_STATES_PER_TP_RANK = "mp_rank_*_model_states.pt"  # below ZeRO-3
MODEL_STATES_PER_RANK = "zero_pp_rank_*_mp_rank_00_model_states.pt"  # ZeRO-3
OPTIMIZER_STATES_OF_TP_RANK_0 = "*mp_rank_00_optim_states.pt"  # one per ZeRO rank ([bf16_]zero_pp_rank_<dp>_...)
# DeepSpeed's BF16_Optimizer's (ZeRO-1 under bf16 with fp32 gradient accumulation, as hpsft runs it)
BF16_OPTIMIZER_STATES = "bf16_zero_pp_rank_*_optim_states.pt"


def model_states(tp_rank: int = 0) -> str:
    """The model file of TP rank `tp_rank` (below ZeRO-3; the only one without TP)."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def universal_file(folder: Path, name: str, state: str) -> Path:
    """Where a universal folder keeps parameter `name`'s `state` (fp32, exp_avg, exp_avg_sq, step)."""
    return folder / UNIVERSAL_STATE / name / f"{state}.pt"


@dataclass(frozen=True)
class Layout:
    """How a checkpoint's state is split over files: as a folder holds it (Layout.of), or as a
    run writes and reads it natively (DeepSpeedEngine.layout)."""

    zero_shards: int  # optimizer-state files per TP rank, one per ZeRO rank; 0 without ZeRO
    tp_size: int  # model files below ZeRO-3, one per TP rank (ZeRO-3 runs without TP: 1)
    zero3: bool  # the module partitioned too: a model file per rank
    universal: bool = False  # DeepSpeed's universal form: per-parameter files

    @classmethod
    def of(cls, folder: Path) -> "Layout | None":
        """What the DeepSpeed checkpoint folder `folder` holds; None: no DeepSpeed checkpoint there."""
        zero3 = bool(list(folder.glob(MODEL_STATES_PER_RANK)))
        tp_size = len(list(folder.glob(MODEL_STATES_PER_TP_RANK)))
        if not (zero3 or (folder / model_states(0)).is_file()):
            return None
        return cls(zero_shards=len(list(folder.glob(OPTIMIZER_STATES_OF_TP_RANK_0))), tp_size=tp_size or 1,
                   zero3=zero3, universal=(folder / UNIVERSAL_STATE).is_dir())


class UniversalState:
    """The per-parameter state of a universal checkpoint folder, each file read when asked."""

    def __init__(self, folder: Path):
        self.folder = folder

    def names(self) -> list[str]:
        """The trained parameters it holds."""
        return sorted(p.name for p in (self.folder / UNIVERSAL_STATE).iterdir() if p.is_dir())

    def tensor(self, name: str, state: str):
        """Parameter `name`'s `state`: its fp32 weight (fp32) or an AdamW moment (MOMENTS)."""
        return torch.load(universal_file(self.folder, name, state), map_location="cpu", weights_only=True)[PARAM]

    def step(self, name: str):
        return torch.load(universal_file(self.folder, name, "step"), weights_only=True)

    def param_groups(self) -> list[dict]:
        """The optimizer's saved param_groups (lr, betas, eps, weight decay)."""
        return torch.load(self.folder / UNIVERSAL_STATE / UNIVERSAL_OPTIMIZER, weights_only=False)[PARAM_GROUPS]
