"""The config sections, one dataclass each; every default lives here and nowhere else.

Choice-valued fields are validated in `__post_init__` so a bad value fails at start-up
with the valid choices named.
"""

from dataclasses import dataclass, field
from typing import Optional


def check_choice(section: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {sorted(choices)}")


def check_positive(section: str, name: str, value, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ValueError(f"{section}.{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ".cache/models/smollm2-135m-4l"
    # auto: flash_attention_2 on GPU with flash-attn installed, else hpsft_varlen (exact
    # per-sequence attention); sdpa/eager: transformers' own (a mask over the whole packed row).
    attn_implementation: str = "auto"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False

    def __post_init__(self):
        check_choice("model", "attn_implementation", self.attn_implementation,
                     {"auto", "hpsft_varlen", "sdpa", "eager", "flash_attention_2"})


@dataclass(frozen=True)
class LossConfig:
    """The fused varlen cross-entropy (hpsft.ops) the training loss goes through."""

    backend: str = "auto"  # auto (CUDA/Triton on GPU, C++ on CPU, else torch) | cpp | cuda | triton | torch
    z_loss_weight: float = 0.0  # adds weight * logsumexp(logits)^2 per token; logged as train/z_loss
    label_smoothing: float = 0.0
    token_accuracy: bool = False  # log train/token_accuracy (re-runs the LM head on loss tokens, no grad)

    def __post_init__(self):
        check_choice("loss", "backend", self.backend, {"auto", "cpp", "triton", "torch"})
        check_positive("loss", "z_loss_weight", self.z_loss_weight, allow_zero=True)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"loss.label_smoothing must be in [0, 1), got {self.label_smoothing}")


@dataclass(frozen=True)
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: [".cache/data/chatterbot/train.parquet"])
    # None by default: a validation split belongs to its training data (configs/sft.yaml names
    # the demo's); a default would silently validate other data on the demo's split.
    val_files: list[str] = field(default_factory=list)
    messages_key: str = "messages"  # multi-turn chat rows (OpenAI style)
    prompt_key: str = "prompt"  # single-turn rows, used when a row has no messages_key
    response_key: str = "response"
    tools_key: str = "tools"  # optional per-row tool schemas passed to the chat template
    chat_template: Optional[str] = None  # Jinja text or a .jinja file path, overriding the tokenizer's
    max_length: int = 1024
    truncation: str = "error"  # error | left | right
    bad_rows: str = "error"  # error | skip (skipped rows are counted and reported)
    train_batch_size: int = 32  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size_per_gpu: int = 8  # sequences per forward/backward on one rank
    max_tokens_per_micro_batch: Optional[int] = None  # token budget; replaces micro_batch_size_per_gpu
    shuffle: bool = True
    num_workers: int = 0
    cache_dir: str = ".cache/tokenized"

    def __post_init__(self):
        check_choice("data", "truncation", self.truncation, {"error", "left", "right"})
        check_choice("data", "bad_rows", self.bad_rows, {"error", "skip"})
        for name in ("max_length", "train_batch_size", "micro_batch_size_per_gpu", "max_tokens_per_micro_batch"):
            check_positive("data", name, getattr(self, name))
        check_positive("data", "num_workers", self.num_workers, allow_zero=True)
        if not self.train_files:
            raise ValueError("data.train_files is empty: give at least one parquet or jsonl file")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < self.max_length:
            # Checked here, not when such a sequence comes: it would fail on one rank mid-run.
            raise ValueError(f"data.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} < "
                             f"data.max_length={self.max_length}: a sequence of max_length tokens would fit in no "
                             "micro-batch; raise the budget or lower data.max_length")


@dataclass(frozen=True)
class EngineConfig:
    zero_stage: int = 2
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer states and step on the CPU
    offload_params: bool = False  # ZeRO-3 only: parameters live on the CPU
    dtype: str = "float32"  # float32 | bfloat16 (bf16 where the hardware has it)
    dist_backend: Optional[str] = None  # default: nccl on GPU, gloo on CPU
    # How long a rank waits in a collective of the default process group for the others before
    # failing: bounds the wait when another rank died without its launcher ending this one.
    # DeepSpeed's own groups (gradient reduction) keep torch's default (docs/checkpoints.md).
    collective_timeout_s: float = 300.0

    def __post_init__(self):
        check_choice("engine", "zero_stage", self.zero_stage, {0, 1, 2, 3})
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
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    log_every: int = 1
    export_hf: bool = True  # write the final model as a Hugging Face folder in <output_dir>/hf
    progress_bar: bool = True
    peak_flops_per_device: Optional[float] = None  # MFU denominator; measured (a GEMM) at start-up when unset

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
            check_choice("trainer", "loggers", name, {"console", "jsonl", "tensorboard"})


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
