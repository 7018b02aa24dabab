"""The config sections, one dataclass each; every default lives here and nowhere else.

Choice-valued fields are validated in `__post_init__` so a bad value fails at start-up
with the valid choices named.
"""

import glob
import importlib.util
import math
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Optional


# data.layout's values: hpsft/data/layouts.py's LAYOUTS, and auto (tests/test_row_layouts.py holds them equal).
ROW_LAYOUTS = ("auto", "messages", "sharegpt", "alpaca", "prompt_response", "prompt_completion")


def check_choice(section: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {sorted(choices)}")


def check_positive(section: str, name: str, value, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ValueError(f"{section}.{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


QUANTIZE_BASE = ("none", "nf4", "int8")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (PEFT) on the model's linear layers; rank 0 trains the whole model."""

    rank: int = 0  # r of the low-rank update B @ A; 0: no LoRA
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input (docs/lora.md: resume with dropout)
    # Module names (or name suffixes) to adapt, as PEFT takes them; all-linear: every linear
    # layer of the decoder (never the LM head, which hpsft's fused loss reads as a weight).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # DoRA (PEFT's use_dora): each adapted weight is a trained magnitude per output times the
    # direction of W + B @ A (docs/lora.md: DoRA).
    use_dora: bool = False
    # The frozen base weight of every adapted layer stored quantised (QLoRA): none, nf4 (4-bit
    # NormalFloat in blocks of 64) or int8 (one scale per output row); docs/lora.md: QLoRA.
    quantize_base: str = "none"
    # nf4's absmax scalers quantised to 8 bits themselves (QLoRA's double quantisation, torchao's
    # NF4Tensor) or kept in fp32 (false); nf4 only.
    double_quant: bool = True

    def __post_init__(self):
        check_positive("model.lora", "rank", self.rank, allow_zero=True)
        check_positive("model.lora", "alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("model.lora.target_modules is empty: name the layers to adapt, or keep [all-linear]")
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ValueError(f"model.lora.target_modules={list(self.target_modules)}: all-linear already names "
                             "every linear layer; give it alone or list module names without it")
        if self.use_dora and not self.rank:
            raise ValueError("model.lora.use_dora=true needs model.lora.rank > 0 (DoRA trains LoRA adapters)")
        check_choice("model.lora", "quantize_base", self.quantize_base, QUANTIZE_BASE)
        if not self.double_quant and self.quantize_base != "nf4":
            raise ValueError(f"model.lora.double_quant=false with model.lora.quantize_base={self.quantize_base}: "
                             "double quantisation is nf4's (its block scalers); remove model.lora.double_quant")
        if self.quantize_base != "none" and not self.rank:
            raise ValueError(f"model.lora.quantize_base={self.quantize_base} needs model.lora.rank > 0 "
                             "(QLoRA trains LoRA adapters on the quantised base)")
        if self.quantize_base != "none" and self.use_dora:
            # PEFT's DoRA layer reads its base layer's weight as a dense tensor (the magnitude's norm).
            raise ValueError(f"model.lora.quantize_base={self.quantize_base} with model.lora.use_dora=true: DoRA on "
                             "a quantised base is not supported; set model.lora.quantize_base=none")
        if self.quantize_base != "none" and importlib.util.find_spec("torchao") is None:
            raise ValueError(f"model.lora.quantize_base={self.quantize_base} needs torchao, which is not installed: "
                             "pip install hpsft[lora]")
        if self.rank and importlib.util.find_spec("peft") is None:
            raise ValueError("model.lora.rank > 0 needs PEFT, which is not installed: pip install hpsft[lora]")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ".cache/models/smollm2-135m-4l"
    # auto: flash_attention_2 on GPU with flash-attn installed, else hpsft_varlen (exact
    # per-sequence attention); sdpa/eager: transformers' own (a mask over the whole packed row).
    attn_implementation: str = "auto"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Run every decoder layer's MLP over the row in tiles of this many tokens, forward and
    # backward (long rows: docs/sequence_parallel.md); None: in one piece.
    tiled_mlp_tokens: Optional[int] = None
    # A vision-language model (docs/vision.md): freeze its vision tower and projector (no
    # gradient, weights unchanged); refused for a text model.
    freeze_vision: bool = False

    def __post_init__(self):
        check_choice("model", "attn_implementation", self.attn_implementation,
                     {"auto", "hpsft_varlen", "sdpa", "eager", "flash_attention_2"})
        check_positive("model", "tiled_mlp_tokens", self.tiled_mlp_tokens)


@dataclass(frozen=True)
class LossConfig:
    """The fused varlen cross-entropy (hpsft.ops) the training loss goes through."""

    backend: str = "auto"  # auto (Triton on GPU, C++ on CPU, else torch) | cpp | triton | torch
    z_loss_weight: float = 0.0  # adds weight * logsumexp(logits)^2 per token; logged as train/z_loss
    label_smoothing: float = 0.0
    token_accuracy: bool = False  # log train/token_accuracy (re-runs the LM head on loss tokens, no grad)

    def __post_init__(self):
        check_choice("loss", "backend", self.backend, {"auto", "cpp", "triton", "torch"})
        check_positive("loss", "z_loss_weight", self.z_loss_weight, allow_zero=True)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"loss.label_smoothing must be in [0, 1), got {self.label_smoothing}")


@dataclass(frozen=True)
class DataSource:
    """One entry of data.train_files or data.val_files: a path, or {path, weight, name}."""

    path: str
    name: str  # in per-dataset metrics (train/loss/<name>); default: default_source_name(path)
    weight: Optional[float]  # sampling weight (train_files only); None: not given


SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def default_source_name(path: str) -> str:
    """A file's or folder's stem; for a glob, the folder it searches (data/train/part-*.parquet:
    train), or `data` when it has none."""
    parts = PurePath(path).parts
    if not any(glob.has_magic(part) for part in parts):
        return PurePath(path).stem
    plain = [PurePath(part).stem for part in parts[:next(i for i, part in enumerate(parts) if glob.has_magic(part))]]
    return next((part for part in reversed(plain) if SOURCE_NAME.fullmatch(part)), "data")


def data_source(key: str, i: int, entry) -> DataSource:
    where = f"data.{key}[{i}]"
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a file path or a mapping {{path, weight, name}}, got {entry!r}")
    unknown = sorted(set(entry) - {"path", "weight", "name"})
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; an entry is a path or {{path, weight, name}}")
    path, weight = entry.get("path"), entry.get("weight")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where} needs a 'path' (the data file), got {path!r}")
    name = entry.get("name", default_source_name(path))
    if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name):
        raise ValueError(f"{where} name {name!r} must be letters, digits, '_', '.' or '-' (it names metrics, "
                         "train/loss/<name>): set 'name'")
    if weight is not None:
        if key == "val_files":
            raise ValueError(f"{where} has a weight: validation evaluates every sequence once, weights apply to "
                             "data.train_files only; remove it")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight)
                                                                                   and weight > 0):
            raise ValueError(f"{where} weight must be a number > 0, got {weight!r}")
        weight = float(weight)
    return DataSource(path, name, weight)


def data_sources(key: str, entries) -> tuple[DataSource, ...]:
    """data.train_files or data.val_files as DataSources, checked: names unique, and weights
    given for every entry or for none (a mixture, or the files concatenated)."""
    sources = tuple(data_source(key, i, entry) for i, entry in enumerate(entries))
    names = [s.name for s in sources]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"data.{key}: {names.count(name)} entries are named {name!r} (a name defaults to the "
                             "file's stem): give each a distinct 'name'")
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        missing = [s.path for s in sources if s.weight is None]
        raise ValueError(f"data.{key}: some entries have a weight and {missing} do not: give every entry a "
                         "weight (a weighted mixture) or none (the files concatenated)")
    return sources


@dataclass(frozen=True)
class CustomClassConfig:
    """A dataset class of the user's, used instead of the built-in one (docs/data.md)."""

    path: Optional[str] = None  # a .py file defining the class
    name: Optional[str] = None  # the class's name in that file

    def __post_init__(self):
        if (self.path is None) != (self.name is None):
            raise ValueError("data.custom_cls needs both path (a .py file) and name (the class in it)")


@dataclass(frozen=True)
class DataConfig:
    # Each entry: a file path, or {path, weight, name} (docs/data.md, "Mixing datasets").
    train_files: list[Any] = field(default_factory=lambda: [".cache/data/chatterbot/train.parquet"])
    # None by default: a validation split belongs to its training data (configs/sft.yaml names
    # the demo's); a default would silently validate other data on the demo's split.
    val_files: list[Any] = field(default_factory=list)  # entries as train_files, without weights
    custom_cls: CustomClassConfig = field(default_factory=CustomClassConfig)
    # The rows' layout: auto (found from each row's keys) | messages | sharegpt | alpaca |
    # prompt_response | prompt_completion; docs/data.md "Row layouts", hpsft/data/layouts.py.
    layout: str = "auto"
    # Column keys (LLaMA-Factory's dataset_info `columns`): None reads the layout's own column.
    messages_key: Optional[str] = None  # the chat turns (messages / conversations)
    role_key: Optional[str] = None  # a turn's speaker (role / from)
    content_key: Optional[str] = None  # a turn's text (content / value)
    prompt_key: Optional[str] = None  # single-turn rows: prompt / instruction
    query_key: Optional[str] = None  # appended to the prompt (Alpaca's input)
    response_key: Optional[str] = None  # response / output / completion
    system_key: Optional[str] = None  # a system prompt column (ShareGPT's, Alpaca's system)
    history_key: Optional[str] = None  # earlier [prompt, response] pairs (Alpaca's history)
    tools_key: str = "tools"  # optional per-row tool schemas passed to the chat template
    chat_template: Optional[str] = None  # Jinja text or a .jinja file path, overriding the tokenizer's
    max_length: int = 1024
    # A row longer than max_length: turns (its leading whole turns; a row no turn of which fits
    # is dropped and counted) | split (several sequences cut at turn boundaries) | error |
    # left | right (cut tokens); docs/data.md "Long conversations".
    truncation: str = "turns"
    # auto | whole | per_turn: one sequence per conversation, or one per assistant turn as the
    # template writes it when that turn is generated (auto: per turn when the template rewrites
    # past turns); docs/data.md "Templates that rewrite history".
    multiturn: str = "auto"
    bad_rows: str = "error"  # error | skip (skipped rows are counted and reported)
    train_batch_size: int = 32  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size_per_gpu: int = 8  # sequences per forward/backward on one rank
    max_tokens_per_micro_batch: Optional[int] = None  # token budget; replaces micro_batch_size_per_gpu
    shuffle: bool = True
    num_workers: int = 0  # DataLoader worker processes; a CUDA run gets at least 1 (data/device_feed.py)
    cache_dir: str = ".cache/tokenized"
    # Worker processes tokenizing on each rank (hpsft/data/preparation.py); None: the cores this
    # process may use divided among the ranks of its node.
    num_proc: Optional[int] = None
    shard_mb: float = 16.0  # input per shard, the unit tokenized in parallel, cached and resumed
    # How each step's global batch is split over data-parallel ranks: equal tokens, or equal
    # tokens plus attention's quadratic term (long sequences weigh more; hpsft/data/balance.py).
    balance: str = "tokens"  # tokens | attention

    def __post_init__(self):
        check_choice("data", "truncation", self.truncation, {"error", "left", "right", "turns", "split"})
        check_choice("data", "multiturn", self.multiturn, {"auto", "whole", "per_turn"})
        check_choice("data", "layout", self.layout, set(ROW_LAYOUTS))
        check_choice("data", "bad_rows", self.bad_rows, {"error", "skip"})
        check_choice("data", "balance", self.balance, {"tokens", "attention"})
        for name in ("max_length", "train_batch_size", "micro_batch_size_per_gpu", "max_tokens_per_micro_batch",
                     "num_proc", "shard_mb"):
            check_positive("data", name, getattr(self, name))
        check_positive("data", "num_workers", self.num_workers, allow_zero=True)
        if not self.train_files:
            raise ValueError("data.train_files is empty: give at least one parquet or jsonl file")
        self.train_sources()
        self.val_sources()
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < self.max_length:
            # Checked here, not when such a sequence comes: it would fail on one rank mid-run.
            raise ValueError(f"data.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} < "
                             f"data.max_length={self.max_length}: a sequence of max_length tokens would fit in no "
                             "micro-batch; raise the budget or lower data.max_length")

    def train_sources(self) -> tuple[DataSource, ...]:
        return data_sources("train_files", self.train_files)

    def val_sources(self) -> tuple[DataSource, ...]:
        return data_sources("val_files", self.val_files)

    def mixture_weights(self) -> Optional[list[float]]:
        """The training sources' sampling weights; None when the files are concatenated."""
        weights = [s.weight for s in self.train_sources()]
        return None if weights[0] is None else weights


@dataclass(frozen=True)
class EngineConfig:
    name: str = "deepspeed"  # the engine (hpsft/engine/factory.py): deepspeed, DeepSpeed ZeRO 0-3
    zero_stage: int = 2  # fp32 ZeRO-1/2 in one process runs without ZeRO (DeepSpeedEngine.zero_stage_to_run)
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer states and step on the CPU
    offload_params: bool = False  # ZeRO-3 only: parameters live on the CPU
    dtype: str = "float32"  # float32 | bfloat16 (bf16 where the hardware has it)
    dist_backend: Optional[str] = None  # default: nccl on GPU, gloo on CPU
    # How long a rank waits in a collective of the default process group for the others before
    # failing: bounds the wait when another rank died without its launcher ending this one.
    # DeepSpeed's own groups (gradient reduction) keep torch's default (docs/checkpoints.md).
    collective_timeout_s: float = 300.0
    # Ulysses sequence parallelism (docs/sequence_parallel.md): each packed row is cut along its
    # tokens across this many ranks.
    sequence_parallel_size: int = 1
    # Tensor parallelism through DeepSpeed's AutoTP (docs/tensor_parallel.md): each decoder
    # layer's linear weights are split over this many ranks. The world is data-parallel size x
    # tensor-parallel size x sequence-parallel size (x pipeline-parallel size): hpsft/utils/distributed.py, Mesh.
    tensor_parallel_size: int = 1
    # Under TP > 1 (DeepSpeed AutoTP): the input embedding and LM head sharded by vocabulary rows
    # over the TP group, the loss vocabulary-parallel (docs/tensor_parallel.md, "The
    # vocabulary-parallel head"). Opt-in: resuming its checkpoints at another TP size and
    # `hpsft export` of them are not built yet (refused); the run's own end export is.
    vocab_parallel_head: bool = False
    # Pipeline parallelism: the decoder layers split into this many stages (an engine that has it).
    pipeline_parallel_size: int = 1
    # Expert parallelism: an MoE layer's experts spread over this many of the data-parallel x
    # sequence-parallel ranks (an engine that has it; the dense layout stays as it is).
    expert_parallel_size: int = 1

    def __post_init__(self):
        check_choice("engine", "zero_stage", self.zero_stage, {0, 1, 2, 3})
        for size in ("sequence", "tensor", "pipeline", "expert"):
            check_positive("engine", f"{size}_parallel_size", getattr(self, f"{size}_parallel_size"))
        if self.name == "deepspeed":
            self.check_deepspeed_parallelism()
        if self.name == "megatron":
            self.check_megatron_options()
        check_choice("engine", "dtype", self.dtype, {"float32", "bfloat16"})
        check_positive("engine", "collective_timeout_s", self.collective_timeout_s)
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("engine.offload_params needs engine.zero_stage=3")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("engine.offload_optimizer needs engine.zero_stage >= 1")
        if self.dtype == "bfloat16" and self.zero_stage == 0:
            # DeepSpeed 0.19.8 without ZeRO: fp32 accumulation raises NotImplementedError, and
            # its default sums the micro-batches' and ranks' gradients in bf16 (docs/precision.md).
            raise ValueError("engine.dtype=bfloat16 needs engine.zero_stage >= 1: without ZeRO, DeepSpeed "
                             "accumulates and all-reduces bf16 gradients in bf16, not fp32 "
                             "(engine.zero_stage=1 keeps the same bf16 weights on every rank)")

    def check_megatron_options(self):
        """What the Megatron engine refuses: sequence parallelism (Ulysses is the DeepSpeed
        engine's; Megatron's context parallelism is not wired) and ZeRO's offload keys."""
        if self.sequence_parallel_size > 1:
            raise ValueError(f"engine.sequence_parallel_size={self.sequence_parallel_size}: engine.name=megatron has "
                             "no sequence parallelism; use engine.sequence_parallel_size=1 (or engine.name=deepspeed)")
        for key in ("offload_optimizer", "offload_params"):
            if getattr(self, key):
                raise ValueError(f"engine.{key}=true is DeepSpeed's ZeRO-Offload: engine.name=megatron has none; "
                                 f"use engine.{key}=false")

    def check_deepspeed_parallelism(self):
        """What the DeepSpeed engine refuses of a layout: pipeline or expert parallelism (DeepSpeed's
        own pipeline engine takes no Hugging Face model as it is, and its MoE layers are its own),
        and AutoTP beside ZeRO-3, without ZeRO or with the optimizer offloaded."""
        for kind in ("pipeline", "expert"):
            size = getattr(self, f"{kind}_parallel_size")
            if size > 1:
                raise ValueError(f"engine.{kind}_parallel_size={size}: engine.name=deepspeed has no {kind} "
                                 f"parallelism; use engine.{kind}_parallel_size=1")
        if self.tensor_parallel_size == 1:
            if self.vocab_parallel_head:
                raise ValueError("engine.vocab_parallel_head=true shards the head over the TP group: it needs "
                                 "engine.tensor_parallel_size > 1")
            return
        tp = f"engine.tensor_parallel_size={self.tensor_parallel_size}"
        if self.zero_stage not in (1, 2):
            # ZeRO-3's gathers and AutoTP's shards are not tested together here; without ZeRO the
            # engine's own gradient norm (clip_unsharded_grads) would count each rank's shards only.
            raise ValueError(f"{tp} needs engine.zero_stage=1 or 2, got {self.zero_stage}")
        if self.offload_optimizer:
            raise ValueError(f"{tp} with engine.offload_optimizer=true is not supported (not tested)")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    lr_scheduler: str = "cosine"  # cosine | constant
    warmup_ratio: float = 0.1  # of total steps
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio

    def __post_init__(self):
        check_choice("optim", "lr_scheduler", self.lr_scheduler, {"cosine", "constant"})
        check_positive("optim", "lr", self.lr)
        check_positive("optim", "grad_clip", self.grad_clip, allow_zero=True)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas must have two values, got {list(self.betas)}")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (trainer.loggers includes wandb). The API key comes from the
    WANDB_API_KEY environment variable only, never from the config (docs/tracking.md)."""

    project: str = "hpsft"
    entity: Optional[str] = None  # None: the key's default entity
    name: Optional[str] = None  # None: W&B's generated run name
    mode: Optional[str] = None  # online | offline; None: the WANDB_MODE environment variable, else online

    def __post_init__(self):
        if self.mode is not None:
            check_choice("trainer.wandb", "mode", self.mode, {"online", "offline"})


@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = 1
    total_steps: Optional[int] = None  # if set, overrides total_epochs (epochs repeat as needed)
    stop_at_step: Optional[int] = None  # end this run early (checkpoint saved), e.g. for a job time limit
    val_every: int = 0  # steps between validations; 0: only at the end
    val_before_train: bool = False  # a fresh run validates the untrained model first (logged at step 0)
    save_every: int = 0  # steps between checkpoints; 0: only at the end
    seed: int = 42
    output_dir: str = "runs/default"
    resume: str = "auto"  # auto (latest in output_dir) | disable | a checkpoint path
    # Resume even from a checkpoint whose run fingerprint (model, data, tokenization, global batch,
    # seed, objective) differs from this run's; a warning names the differences.
    resume_force: bool = False
    # With resume=disable: delete a previous run's checkpoints, metrics, TensorBoard logs and hf/
    # in output_dir first (without it such a directory is refused).
    overwrite_output_dir: bool = False
    keep_last_checkpoints: int = 0  # 0: keep every checkpoint; N: the newest N (the one just saved always)
    max_skipped_steps: int = 10  # this many steps in a row with a non-finite gradient norm stop the run
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])  # + wandb
    wandb: WandbConfig = field(default_factory=WandbConfig)
    log_every: int = 1
    export_hf: bool = True  # write the final model as a Hugging Face folder in <output_dir>/hf
    progress_bar: bool = True
    # MFU denominator; unset: a known GPU's dense datasheet peak (hpsft/utils/perf.py), else a GEMM measured at start-up
    peak_flops_per_device: Optional[float] = None
    # [first, last] optimizer steps (both included, counted from 1) to record with torch.profiler
    # into <output_dir>/profile/, on the data-parallel ranks in profile_ranks.
    profile_steps: Optional[list[int]] = None
    profile_ranks: list[int] = field(default_factory=lambda: [0])

    def __post_init__(self):
        check_positive("trainer", "total_epochs", self.total_epochs)
        check_positive("trainer", "total_steps", self.total_steps)
        check_positive("trainer", "stop_at_step", self.stop_at_step)
        check_positive("trainer", "val_every", self.val_every, allow_zero=True)
        check_positive("trainer", "save_every", self.save_every, allow_zero=True)
        check_positive("trainer", "log_every", self.log_every)
        check_positive("trainer", "keep_last_checkpoints", self.keep_last_checkpoints, allow_zero=True)
        check_positive("trainer", "max_skipped_steps", self.max_skipped_steps)
        if self.overwrite_output_dir and self.resume != "disable":
            raise ValueError(
                f"trainer.overwrite_output_dir=true needs trainer.resume=disable (resume={self.resume!r} would "
                "delete what it resumes from)"
            )
        for name in self.loggers:
            check_choice("trainer", "loggers", name, {"console", "jsonl", "tensorboard", "wandb"})
        if self.profile_steps is not None and (len(self.profile_steps) != 2
                                               or not 1 <= self.profile_steps[0] <= self.profile_steps[1]):
            raise ValueError(f"trainer.profile_steps must be [first, last] with 1 <= first <= last (steps counted "
                             f"from 1, both profiled), got {list(self.profile_steps)}")
        if any(rank < 0 for rank in self.profile_ranks):
            raise ValueError(f"trainer.profile_ranks must be ranks >= 0, got {list(self.profile_ranks)}")


@dataclass(frozen=True)
class RayConfig:
    """The Ray path only (python -m hpsft.train_ray); the SPMD path ignores it."""

    address: Optional[str] = None  # None: start a local Ray instance sized for this machine; else ray.init(address)
    nnodes: int = 1
    n_workers_per_node: int = 2  # one DeepSpeed rank each; a GPU each where the cluster has GPUs
    cpus_per_worker: float = 1.0  # fractional values let several ranks share a core
    max_restarts: int = 0  # on a dead worker: recreate the group and resume from the last checkpoint
    placement_timeout_s: float = 120.0  # fail when the cluster cannot hold the workers within this time
    # A worker call (model build, step, checkpoint, export) unanswered after this long counts
    # as a lost worker, restartable like a dead one: under the 30-minute collective timeout
    # after which the other ranks would fail instead. None: wait for ever.
    call_timeout_s: Optional[float] = 1200.0

    def __post_init__(self):
        for name in ("nnodes", "n_workers_per_node", "cpus_per_worker", "placement_timeout_s"):
            check_positive("ray", name, getattr(self, name))
        check_positive("ray", "call_timeout_s", self.call_timeout_s)  # None passes: no timeout
        check_positive("ray", "max_restarts", self.max_restarts, allow_zero=True)


@dataclass(frozen=True)
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        lora = self.model.lora
        if self.engine.name == "megatron":
            lora_keys = (f"model.lora.rank={lora.rank}" + (", model.lora.use_dora=true" if lora.use_dora else "")
                         + (f", model.lora.quantize_base={lora.quantize_base}" if lora.quantize_base != "none" else ""))
            for keys, value in ((lora_keys, lora.rank), (f"model.tiled_mlp_tokens={self.model.tiled_mlp_tokens}",
                                                         self.model.tiled_mlp_tokens)):
                if value:
                    raise ValueError(f"{keys} with engine.name=megatron: not on the Megatron engine yet; "
                                     "use engine.name=deepspeed")
        tp = self.engine.tensor_parallel_size
        if tp > 1 and self.model.lora.rank:
            # AutoTP would shard the base layers PEFT wraps: not shown exact, so not run.
            raise ValueError(f"engine.tensor_parallel_size={tp} with model.lora.rank={self.model.lora.rank}: LoRA "
                             "under tensor parallelism is not supported; use engine.tensor_parallel_size=1")
        if tp > 1 and self.model.tiled_mlp_tokens is not None:
            raise ValueError(f"engine.tensor_parallel_size={tp} with model.tiled_mlp_tokens: tiled MLPs under "
                             "tensor parallelism are not supported (each rank's MLP is already 1/TP wide)")
