"""Saving the engine's state, and loading a checkpoint written with any layout (docs/checkpoints.md).

ZeRO 1-3 keep one optimizer shard per ZeRO rank; without ZeRO one file holds the whole state;
AutoTP one model file per TP rank (layout.py). A checkpoint of this run's own layout is loaded
by DeepSpeed itself; one of another layout is first converted to DeepSpeed's universal form
(per-parameter, dp- and tp-independent: the TP slices merged) and loaded from there
(universal.py). The module state holds no frozen parameter: they are the base model's, read
from model.path again on resume (the run fingerprint checks it is the same), and a LoRA
checkpoint is then the adapters and their optimizer state only.
"""

import contextlib
import functools
import re
from pathlib import Path

from deepspeed.checkpoint.constants import (AFFINE_MAP, AFFINE_MAP_PARAMS, ORIGINAL_VOCAB_SIZE,
                                            TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_INFO,
                                            VOCABULARY_PARAMETER_PATTERNS)
from torch import nn

from hpsft.engine.deepspeed.layout import Layout
from hpsft.engine.deepspeed.universal import (load_through_universal, load_universal_into_zero,
                                              load_universal_without_zero, to_universal, to_universal_without_zero,
                                              unsharded_to_universal)
from hpsft.engine.optimizer import param_groups
from hpsft.models.vocab_parallel_head import vocab_rows_of
from hpsft.utils.errors import UserInputError


def frozen_names(module: nn.Module) -> set[str]:
    """Every name under which a frozen parameter appears in the state dict (a tied one under each),
    and the buffers a module names in its `frozen_buffers`: frozen weights held as buffers (QLoRA's
    NF4 base, hpsft/models/qlora.py), built from model.path again as frozen parameters are."""
    buffers = {f"{prefix}.{name}" if prefix else name for prefix, sub in module.named_modules()
               for name in getattr(sub, "frozen_buffers", ())}
    params = module.named_parameters(remove_duplicate=False)
    return buffers | {name for name, param in params if not param.requires_grad}


@contextlib.contextmanager
def frozen_parameters_left_out(module: nn.Module):
    """While a checkpoint is saved, the module's state dict holds no frozen parameter (nor frozen buffer).
    DeepSpeed's own exclude_frozen_parameters misses a tied weight's second name (e.g. a frozen
    lm_head.weight tied to the embedding), which would store the whole embedding."""
    frozen = frozen_names(module)

    def drop_frozen(_module, state_dict, prefix, _local_metadata):
        for name in frozen:
            state_dict.pop(prefix + name, None)

    handle = module.register_state_dict_post_hook(drop_frozen)
    try:
        yield
    finally:
        handle.remove()


def load_trained_state(src: dict, dst: nn.Module) -> None:
    """Load a checkpoint's module state: every state entry but the frozen parameters and buffers, strictly."""
    result = dst.load_state_dict(src, strict=False)
    missing = set(result.missing_keys) - frozen_names(dst)
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint does not hold this model's trained state: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(result.unexpected_keys)[:5]}")


# Written beside DeepSpeed's files by a run with engine.vocab_parallel_head=true: its embedding and
# LM head are vocabulary-row shards (hpsft/models/vocab_parallel_head.py).
VOCAB_PARALLEL_HEAD = "vocab_parallel_head.json"


def record_vocabulary_shards(module: nn.Module) -> None:
    """Describe engine.vocab_parallel_head's embedding/head rows in the universal-checkpoint record
    DeepSpeed's AutoTP keeps on `module` (and writes into every checkpoint). AutoTP wrote it at
    initialize and took those shards, which carry none of its own metadata, for TP-replicated
    weights: the universal conversion would keep one rank's rows as the whole weight. Recorded as
    vocabulary-parallel instead, the conversion concatenates the TP ranks' rows and cuts the
    padding (DeepSpeed's vocabulary-tensor path), and a load at any TP size, sharded or not,
    pads and cuts them again."""
    info = getattr(module, UNIVERSAL_CHECKPOINT_INFO)
    sharded = {name: rows for name, param in module.named_parameters() if (rows := vocab_rows_of(param))}
    # AutoTP's patterns are each one parameter's exact name (`^name$`), so the shards' own
    # patterns are the entries to move.
    patterns = {rf"^{re.escape(name)}$" for name in sharded}
    info[TP_REPLICATED_PARAMETER_PATTERNS] = [p for p in info[TP_REPLICATED_PARAMETER_PATTERNS] if p not in patterns]
    affine_params = info.get(AFFINE_MAP, {}).get(AFFINE_MAP_PARAMS, {})
    for pattern in patterns:
        affine_params.pop(pattern, None)
    info[VOCABULARY_PARAMETER_PATTERNS] = sorted(set(info[VOCABULARY_PARAMETER_PATTERNS]) | set(patterns))
    info[ORIGINAL_VOCAB_SIZE] = next(iter(sharded.values())).vocab_size


def check_vocab_parallel_resume(folder: Path, vocab_parallel_head: bool) -> None:
    """Refuse a run with engine.vocab_parallel_head=true resuming a checkpoint whose embedding/head
    is whole: its record calls them TP-replicated, which DeepSpeed's universal load cannot cut
    into vocabulary rows (the other way round it can: record_vocabulary_shards)."""
    if vocab_parallel_head and not (folder / VOCAB_PARALLEL_HEAD).exists():
        raise UserInputError(f"{folder} was written with engine.vocab_parallel_head=false: resume it with the same "
                             "setting (a checkpoint written with it true resumes either way)")


def save(ds_engine, root: str, tag: str, tp_size: int) -> None:
    """DeepSpeed engine `ds_engine`'s state under root/tag (a collective)."""
    # ds_to_universal requires this key: without TP no model-parallel slicing patterns; under
    # AutoTP DeepSpeed writes its own (which parameters are row- or column-parallel, which
    # replicated), and this key in client_state would overwrite them.
    client_state = {} if tp_size > 1 else {UNIVERSAL_CHECKPOINT_INFO: {}}
    with frozen_parameters_left_out(ds_engine.module):
        ds_engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False,
                                  exclude_frozen_parameters=True)


def load_native(ds_engine, root: str, tag: str, load_optimizer_states: bool = True, load_module: bool = True) -> None:
    """DeepSpeed's own load; without `load_module` the module's weights are left as they are
    (the caller sets them)."""
    load_module_state = load_trained_state if load_module else lambda src, dst: None
    path, _ = ds_engine.load_checkpoint(root, tag=tag, custom_load_fn=load_module_state,
                                        load_optimizer_states=load_optimizer_states)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {root}")


def load(ds_engine, root: str, tag: str, run: Layout, stage: int, grad_clip: float,
         vocab_parallel_head: bool = False) -> None:
    """Load root/tag into DeepSpeed engine `ds_engine`, which runs ZeRO stage `stage` in the
    layout `run`, whatever the layout the checkpoint was written in (below ZeRO-3; ZeRO-3
    resumes ZeRO 1-3 checkpoints of any shard count). `grad_clip`: this run's, which DeepSpeed's
    ZeRO optimizer takes from a universal checkpoint."""
    folder = Path(root) / tag
    saved = Layout.of(folder)
    if saved is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {root}")
    check_vocab_parallel_resume(folder, vocab_parallel_head)
    # A vocabulary-sharded checkpoint into a run with whole embedding/head: other shapes, even at
    # the same layout, so through the universal conversion.
    same_head = (folder / VOCAB_PARALLEL_HEAD).exists() == vocab_parallel_head
    if (stage == 0 and saved.zero3) or (stage == 3 and not saved.zero_shards):
        # DeepSpeed converts between ZeRO-3 and the other layouts only through its ZeRO-3
        # universal loader, which needs state a checkpoint without ZeRO never had.
        raise ValueError(f"{folder} was written {'with ZeRO-3' if saved.zero3 else 'without ZeRO'} and this run "
                         f"has {'no ZeRO' if stage == 0 else 'ZeRO-3'}: resume it with the engine.zero_stage it was "
                         "written with")
    native = functools.partial(load_native, ds_engine)
    into_zero = functools.partial(load_universal_into_zero, ds_engine, native)
    without_zero = functools.partial(load_universal_without_zero, ds_engine, native)
    if stage == 0 and saved.zero_shards:
        load_through_universal(root, tag, f"has {saved.zero_shards} ZeRO shards and this run none",
                               lambda out: to_universal_without_zero(folder, out), without_zero)
    elif stage > 0 and not saved.zero_shards:
        names = {param: name for name, param in ds_engine.module.named_parameters()}
        trained = [names[param] for group in param_groups(ds_engine.module, 0.0) for param in group["params"]]
        load_through_universal(root, tag, f"was written without ZeRO and this run has ZeRO-{stage}",
                               lambda out: unsharded_to_universal(folder, out, trained, grad_clip), into_zero)
    elif (saved.zero_shards, saved.tp_size) == (run.zero_shards, run.tp_size) and same_head:
        native(root, tag)
    else:
        layouts = ("holds a vocabulary-sharded embedding/head and this run whole ones" if not same_head else
                   f"has {saved.zero_shards} ZeRO shards, this run {run.zero_shards} ranks"
                   if saved.tp_size == run.tp_size == 1 else
                   f"has {saved.zero_shards} ZeRO shards x {saved.tp_size} TP ranks, this run {run.zero_shards} x "
                   f"{run.tp_size}")
        load_through_universal(root, tag, layouts, lambda out: to_universal(folder, out), into_zero)
