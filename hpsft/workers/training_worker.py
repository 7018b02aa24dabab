"""TrainingWorker: one data-parallel rank's model, engine and micro-batching.

The same class runs in-process under torchrun/deepspeed/srun and inside a Ray actor. It
takes this rank's share of a global batch (a jagged TensorDict), splits it into
micro-batches (as many as every other rank runs), and returns plain Python metrics.
Where the rank sits, and what it counts, is its Mesh's (hpsft/utils/distributed.py), built once
at start-up. With sequence parallelism the SP ranks of a group get the same share, plan the same
packed rows and each trains its own token slice of every row (data/sequence_split.py); every
count it returns is then its slice's share, so that sums over all ranks stay right. With tensor
(or pipeline) parallelism the TP (PP) ranks of a group also get the same share and plan the same
rows, each running its shards (its stage) of the layers on the whole rows; the group's counts are
then returned by one of its ranks only (Mesh.reports_counts; the others return zeros), for the
same sums.
"""

import contextlib
import time
from pathlib import Path
from typing import Callable

import torch

from hpsft.utils import distributed
from hpsft.data.batch import loss_token_count, packed_row, select, seqlens
from hpsft.data.device_feed import DeviceFeed, device_feed, pinned
from hpsft.data.microbatch import min_micro_batches, plan_micro_batches
from hpsft.data.sequence_split import real_tokens, split_row
from hpsft.engine import TrainEngine, build_engine
from hpsft.models import (PackedCausalLM, check_supported, load_causal_lm, verify_packed_training, weight_names,
                          write_hf_folder)
from hpsft.models.hf_export import DEFAULT_MAX_SHARD_MB
from hpsft.models.loading import load_qlora_causal_lm
from hpsft.models.lora import (add_lora, adapter_names, describe, gather_dora_base_weights, merged_weights,
                               write_adapter_folder)
from hpsft.models.packed_vision_lm import PackedVisionLM, check_vision_supported, is_vision_language
from hpsft.models.partitioned import is_partitioned
from hpsft.models.tensor_parallel import check_tensor_parallel
from hpsft.models.tiled_mlp import tile_mlps
from hpsft.models.ulysses_attention import check_heads
from hpsft.models.varlen_attention import ATTN_IMPLEMENTATION
from hpsft.utils.perf import device_peak, flop_counts, model_flops, rss_anon_bytes
from hpsft.utils.profiling import StepProfiler
from hpsft.utils.progress import progress_bar
from hpsft.workers.base import Worker
from hpsft.workers.faults import InjectedFaults
from hpsft.workers.step_result import StepResult


def token_mean_loss(outputs: dict, global_loss_tokens: int) -> torch.Tensor:
    """Sum of this micro-batch's token losses over the loss tokens of the whole optimizer
    step (all micro-batches, all ranks): the gradient is then the same whatever the
    data-parallel size, the micro-batch split or the packing."""
    return outputs["loss"] / max(global_loss_tokens, 1)


class TrainingWorker(Worker):
    def __init__(self, model_config, loss_config, engine_config, optim_config, data_config, total_steps: int,
                 mesh: distributed.Mesh, peak_flops: float | None = None, seed: int = 0):
        self.model_config = model_config
        self.seed = seed  # of the LoRA adapters' initialisation
        self.loss_config = loss_config
        self.engine_config = engine_config
        self.data_config = data_config
        self.peak_flops_per_device = peak_flops  # measured in init_model when None
        self.mesh = mesh.at(distributed.rank())  # this process's place (a Ray driver's mesh has none)
        self.engine: TrainEngine = build_engine(engine_config, optim_config, total_steps, self.mesh)
        self.n_sources = len(data_config.train_files)  # per-source losses are summed when more than one
        self.faults = InjectedFaults.from_environment()  # the tests' (hpsft/workers/faults.py): none in a real run
        self.profiler: StepProfiler | None = None  # while trainer.profile_steps are running on this rank
        self.feed: DeviceFeed | None = None  # what the rows are built in: set in init_model, from the engine's device
        self.lm = None  # the Hugging Face model init_model builds (the engine trains it inside PackedCausalLM)

    def init_model(self) -> None:
        cfg = self.model_config
        qlora = cfg.lora.quantize_base != "none"
        if qlora:
            # Built with its adapters, each adapted weight quantised as it is read: never the whole
            # fp32 model. Under ZeRO-3 deepspeed.initialize partitions the parameters left
            # (embeddings, head, norms, adapters); the quantised weights, buffers, stay whole on each rank.
            lm = load_qlora_causal_lm(cfg.path, cfg.lora, self.seed, cfg.attn_implementation,
                                      cfg.gradient_checkpointing, cfg.trust_remote_code)
        else:
            # An engine that partitions the model (ZeRO-3) has it built so: no rank ever holds all of
            # it. Except DoRA's: its magnitudes (the rows' norms) need each adapted layer's whole weight,
            # so it is built whole and deepspeed.initialize partitions it.
            lm = load_causal_lm(cfg.path, cfg.attn_implementation, cfg.gradient_checkpointing,
                                cfg.trust_remote_code, model_init=None if cfg.lora.use_dora else self.engine.model_init)
        vision = is_vision_language(lm)
        text_config = lm.config.get_text_config()  # a vision-language model's decoder's (else the model's own)
        if vision:
            check_vision_supported(lm)
        else:  # model.freeze_vision on a text model: refused by the trainer (check_model_settings)
            check_supported(lm, lm.config._attn_implementation)
        # flash-attn runs only on a GPU in 16-bit, and a ZeRO-3 model runs only inside the engine:
        # those are checked once the engine has moved (and cast) the weights; every other model
        # here, in fp32 before DeepSpeed casts the weights for bf16 (a tighter tolerance).
        # hpsft_varlen on a GPU runs torch's varlen flash kernel only in 16-bit: checked in the engine too.
        attention = lm.get_decoder().config._attn_implementation
        verify_in_engine = is_partitioned(lm) or attention == "flash_attention_2" or (
            attention == ATTN_IMPLEMENTATION and torch.cuda.is_available())
        if torch.cuda.is_available():
            # cuDNN's SDPA builds a graph for every new shape (1.4-1.9 ms of host time a call on
            # an H200, measured): packed rows change shape every step. Flash/efficient instead.
            torch.backends.cuda.enable_cudnn_sdp(False)
        mesh = self.mesh
        check_tensor_parallel(text_config, mesh.tp_size)  # before DeepSpeed: a refusal costs nothing yet
        check_heads(text_config, mesh.sp_size, mesh.tp_size)
        if not verify_in_engine and not vision:  # a vision model's packed path: tests/test_vision_lm.py
            verify_packed_training(lm)
        if cfg.lora.rank:
            # After the packed-path check of the base model (QLoRA's: of the model with its adapters):
            # the adapters start at B = 0, so the model computes the same; under ZeRO-3 the base stays
            # partitioned and DeepSpeed partitions the new adapter parameters (broadcast from rank 0)
            # when it wraps the model.
            if not qlora:
                add_lora(lm, cfg.lora, self.seed)
            if cfg.lora.use_dora and self.engine_config.zero_stage == 3:
                gather_dora_base_weights(lm)
            if distributed.rank() == 0:
                print(f"hpsft: {describe(lm)}", flush=True)
        self.body_params, self.head_params = flop_counts(lm)  # frozen weights count less (no weight gradient)
        self.n_layers, self.hidden_size = text_config.num_hidden_layers, text_config.hidden_size
        loss = self.loss_config
        loss_options = dict(loss_backend=loss.backend, z_loss_weight=loss.z_loss_weight,
                            label_smoothing=loss.label_smoothing, token_accuracy=loss.token_accuracy)
        # LoRA trains the adapters alone (on the language model): the tower and projector stay frozen.
        packed = (PackedVisionLM(lm, freeze_vision=cfg.freeze_vision or cfg.lora.rank > 0, **loss_options) if vision
                  else PackedCausalLM(lm, **loss_options))
        self.engine.initialize(packed, head_weight=packed.head_weight)  # under TP, AutoTP shards the layers here
        self.lm = lm
        self.feed = device_feed(self.engine.device)
        if verify_in_engine and not vision:  # in the engine's dtype, with that dtype's tolerance
            verify_packed_training(lm, gathered=self.engine.gathered)
        if cfg.tiled_mlp_tokens is not None:  # after the checks above, which compare with the untiled model
            tile_mlps(lm, cfg.tiled_mlp_tokens)
        if mesh.sp_size > 1:  # after the whole-row checks above, which run without the group
            packed.enable_sequence_parallel(distributed.sequence_parallel_group(mesh), mesh.sp_size, mesh.sp_rank,
                                            mesh.tp_size)
        dtype = torch.bfloat16 if self.engine_config.dtype == "bfloat16" else torch.float32
        rows = min(self.data_config.max_tokens_per_micro_batch or 2048, 4096)
        self.peak = device_peak(self.peak_flops_per_device, self.engine.device, dtype,
                                (rows, text_config.hidden_size, text_config.intermediate_size))
        if distributed.rank() == 0:
            print(f"hpsft: MFU peak per device: {self.peak.source}", flush=True)

    def step_loss(self, step: int, global_loss_tokens: int) -> tuple[Callable, float | None]:
        """The step's loss of a micro-batch's outputs (token_mean_loss), and what it multiplies the
        module's loss by (the engine may then sum the LM head's gradient into its own fp32 one:
        TrainEngine.train_batch's loss_weight). A test's non-finite-gradient step
        (faults.py) goes through autograd only."""
        transform = self.faults.loss_transform(step)
        if transform is None:
            return (lambda out: token_mean_loss(out, global_loss_tokens)), 1 / max(global_loss_tokens, 1)
        return (lambda out: transform(token_mean_loss(out, global_loss_tokens))), None

    def micro_batches(self, batch) -> tuple[list, list[list[int]]]:
        """This rank's micro-batches (packed rows, or this SP rank's slices of them) and the
        sample positions in each."""
        lengths = seqlens(batch).tolist()
        mbs, budget = self.data_config.micro_batch_size_per_gpu, self.data_config.max_tokens_per_micro_batch
        count = distributed.all_reduce_max(min_micro_batches(lengths, mbs, budget))
        bins = plan_micro_batches(lengths, count, mbs, budget)
        rows = [packed_row(select(batch, b)) for b in bins]
        if self.mesh.sp_size > 1:
            rows = [split_row(row, self.mesh.sp_rank, self.mesh.sp_size) for row in rows]
        return [pinned(row, self.feed) for row in rows], bins

    def global_loss_tokens(self, batch) -> int:
        """The loss-token count of the whole global batch from this rank's share (a collective;
        the ranks of a replica hold the same share: counted once, Mesh.replica_size)."""
        total = distributed.all_reduce_sum([loss_token_count(batch)])[0]
        return int(total) // self.mesh.replica_size

    def train_batch(self, batch, global_loss_tokens: int) -> StepResult:
        """One optimizer step on this rank's share of the global batch; the loss is normalised
        by `global_loss_tokens` (global_loss_tokens() under SPMD; the Ray driver, which sees the
        whole batch, counts it itself)."""
        step = self.engine.steps + 1
        self.faults.strike(self.mesh.rank, step)
        lengths = seqlens(batch).tolist()
        rows, bins = self.micro_batches(batch)
        start = time.perf_counter()
        with self.profiler.annotate_step() if self.profiler else contextlib.nullcontext():
            # with several training sources, per-sequence NLLs for the per-source losses
            loss_fn, loss_weight = self.step_loss(step, global_loss_tokens)
            result = self.engine.train_batch(rows, loss_fn, sequence_nll=self.n_sources > 1, loss_weight=loss_weight)
        seconds = time.perf_counter() - start
        # An SP rank does 1/SP of its replica's work (attention included: its share of the heads),
        # a TP rank about 1/TP (its shards; the replicated LM head and norms are not split out), a
        # PP rank about 1/PP (its stage's layers).
        flops = model_flops(self.body_params, self.head_params, self.n_layers, self.hidden_size, lengths,
                            loss_token_count(batch)) / self.mesh.replica_size
        outputs = result.outputs
        nll_sum = sum(float(o["nll"]) for o in outputs)
        loss_tokens = sum(int(o["n_tokens"]) for o in outputs)  # this rank's (with SP: its slices')
        source_nll_sums, source_loss_tokens = (self.source_sums(batch, bins, outputs) if self.n_sources > 1
                                               else ([nll_sum], [loss_tokens]))
        return StepResult(
            objective_sum=sum(float(o["loss"]) for o in outputs),
            nll_sum=nll_sum,
            z_loss_sum=sum(float(o["z_loss"]) for o in outputs),
            router_aux_loss_sum=sum(float(o["router_aux_loss"]) * int(o["n_tokens"]) for o in outputs),
            correct_tokens=sum(int(o["correct"]) for o in outputs),
            loss_tokens=loss_tokens,
            tokens=sum(real_tokens(sum(lengths[i] for i in b), self.mesh.sp_rank, self.mesh.sp_size) for b in bins),
            computed_tokens=sum(r["input_ids"].numel() for r in rows),
            source_nll_sums=source_nll_sums,
            source_loss_tokens=source_loss_tokens,
            flops=flops,
            # The trainer's step time contains this rank's engine time, so its MFU reading stays <= 1.
            peak_flops=self.peak.covering(flops / seconds),
            rss_anon_bytes=rss_anon_bytes(),
            micro_batches=len(rows),
            grad_norm=result.grad_norm,
            lr=result.lr,
        ).counted_once(reports=self.mesh.reports_counts)

    def source_sums(self, batch, bins: list[list[int]], outputs: list[dict]) -> tuple[list[float], list[float]]:
        """NLL sums and loss-token counts per training source of this rank's share."""
        nll_sums = torch.zeros(self.n_sources, dtype=torch.float64)
        loss_tokens = torch.zeros(self.n_sources, dtype=torch.float64)
        for positions, out in zip(bins, outputs):
            if positions:  # an empty bin ran a placeholder row only to keep step with other ranks
                sources = batch["source"][torch.as_tensor(positions, dtype=torch.int64)]
                nll_sums.index_add_(0, sources, out["sequence_nll"].cpu().double())
                loss_tokens.index_add_(0, sources, out["sequence_tokens"].cpu().double())
        return nll_sums.tolist(), loss_tokens.tolist()

    def start_profiler(self, folder: str, ranks: list[int], first_step: int) -> None:
        """Profile the following train_batch calls (steps first_step, first_step + 1, ...) if
        this rank is in `ranks`."""
        if distributed.rank() in ranks:
            self.profiler = StepProfiler(Path(folder), distributed.rank(), first_step)

    def stop_profiler(self) -> None:
        """Write the trace and table of the profiled steps (hpsft/utils/profiling.py)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def infer_batch(self, batch) -> dict:
        """Per-sequence NLL sums and loss-token counts (no gradients), in the batch's order; with
        sequence parallelism this rank's share of them (its slices'), which add up over the group."""
        n = batch.batch_size[0]
        nll_sums = torch.zeros(n, dtype=torch.float64)
        loss_tokens = torch.zeros(n, dtype=torch.int64)
        rows, bins = self.micro_batches(batch)
        for row, positions in zip(rows, bins):
            out = self.engine.infer_batch([row])[0]
            if positions:  # an empty bin ran a placeholder row only to keep step with other ranks
                nll_sums[positions] = out["nll"].cpu().double()
                loss_tokens[positions] = out["n_tokens"].cpu()
        if not self.mesh.reports_counts:  # one rank of a TP (PP) group reports the group's sequences
            nll_sums.zero_(), loss_tokens.zero_()
        return {"nll_sum": nll_sums, "loss_tokens": loss_tokens}

    def save_checkpoint(self, root: str, tag: str) -> None:
        self.engine.save_checkpoint(root, tag)

    def load_checkpoint(self, root: str, tag: str) -> None:
        self.faults.strike(self.mesh.rank, "load_checkpoint")
        self.engine.load_checkpoint(root, tag)

    def export_hf(self, out_dir: str, tokenizer, max_shard_mb: int = DEFAULT_MAX_SHARD_MB,
                  progress: bool = False) -> None:
        """Write the model + tokenizer as a Hugging Face folder: rank 0 writes safetensors shards
        as the engine hands it one whole tensor at a time (gathered under ZeRO-3), with a
        progress bar if `progress`; a collective, every rank calls it. A LoRA model is written
        merged, and its adapter alone (PEFT's format) goes to <out_dir>/adapter."""
        lm = self.lm
        lora = self.model_config.lora.rank > 0
        names = weight_names(lm)
        tensors = self.engine.gathered_tensors(names)
        if distributed.rank() == 0:
            tensors = progress_bar(progress, iterable=tensors, total=len(names), desc="export", unit="tensor")
            write_hf_folder(lm.config, lm.generation_config if lm.can_generate() else None,
                            merged_weights(lm, tensors, self.model_config.lora) if lora else tensors, tokenizer, Path(out_dir), max_shard_mb,
                            self.model_config.path)
        else:
            for _ in tensors:  # take part in every gather
                pass
        if lora:
            adapter = dict(self.engine.gathered_tensors(adapter_names(lm)))  # every rank takes part
            if distributed.rank() == 0:
                write_adapter_folder(lm, adapter, self.model_config.path, tokenizer, Path(out_dir) / "adapter")
