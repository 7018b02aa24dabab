"""SFTTrainer (SPMD): every process runs it, one data-parallel rank each.

Builder sequence as in verl: config -> tokenizer and datasets -> worker (model + engine)
-> dataloader -> checkpoint manager -> fit(). The trainer owns the loop, the loss
normalisation inputs, logging and checkpoint timing; it never imports Ray.
"""

import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hpsft.utils import distributed
from hpsft.config import SFTConfig, to_yaml
from hpsft.data.batch import collate_jagged, empty_batch
from hpsft.data.custom_dataset import load_custom_class
from hpsft.data.device_feed import device_feed, loader_options
from hpsft.data.preparation import (LocalRunner, Team, TeamRunner, default_num_proc, make_cache_folder,
                                    prepared_store)
from hpsft.data.rows import TokenizeOptions, chat_template_text
from hpsft.data.balance import SequenceCost
from hpsft.data.sampler import StepBatchSampler
from hpsft.data.sources import SourcedDataset
from hpsft.engine import engine_class
from hpsft.utils.errors import Preempted, UserInputError
from hpsft.models import load_tokenizer
from hpsft.models.loading import check_model_path, has_vision_tower, load_image_processor, model_config
from hpsft.models.vision_cost import VisionTowerCost
from hpsft.utils.progress import progress_bar, step_postfix
from hpsft.trainer.tracking import Tracker, check_trackers_available
from hpsft.trainer.checkpoint import RUN_FINGERPRINT, CheckpointManager, warn
from hpsft.trainer.fingerprint import differences, run_fingerprint
from hpsft.trainer.nonfinite import SkippedSteps
from hpsft.trainer.preemption import PreemptionWatch
from hpsft.trainer.rng import rng_state, seed_everything, set_rng_state
from hpsft.trainer.run_dir import clear_previous_run, fresh_start_problem, unwritable_problem
from hpsft.workers import TrainingWorker, Worker
from hpsft.workers.faults import InjectedFaults
from hpsft.workers.step_result import StepResult


def build_dataset(sources, tokenizer, data_config, runner=None, report: bool = False,
                  bar: bool = False, processor=None) -> SourcedDataset:
    """One dataset per source (DataSource), seen as one. Built-in: each source's token store,
    prepared by `runner` where it is not complete yet (hpsft/data/preparation.py); `report`:
    this process prints what is prepared, with a progress bar if `bar`; `processor`: a
    vision-language model's image processor (its rows' images go into the store too). A custom class
    (data.custom_cls) is built on every rank from its source's path."""
    custom = data_config.custom_cls
    if custom.path is not None:
        cls = load_custom_class(custom.path, custom.name)
        datasets = [cls(data_files=[s.path], tokenizer=tokenizer, config=data_config) for s in sources]
        return SourcedDataset(datasets, [s.name for s in sources], data_config.max_length,
                              f"class {custom.name} of {custom.path}")
    opts = TokenizeOptions.from_data_config(data_config)
    stores = [prepared_store(s.path, tokenizer, opts, data_config.cache_dir, runner, data_config.shard_mb, s.name,
                             report, bar, processor) for s in sources]
    return SourcedDataset(stores, [s.name for s in sources], data_config.max_length, "built-in dataset")


def check_vision_layout(config: SFTConfig) -> None:
    """What a vision-language model does not train under yet (docs/vision.md), refused by name."""
    engine, lora = config.engine, config.model.lora
    refused = [(engine.name != "deepspeed", f"engine.name={engine.name}", "engine.name=deepspeed"),
               (engine.tensor_parallel_size > 1, f"engine.tensor_parallel_size={engine.tensor_parallel_size}",
                "engine.tensor_parallel_size=1"),
               # LoRA is tested on one process and DP=2 ZeRO-2 (tests/test_vision_lora.py), not with these.
               (lora.rank > 0 and engine.zero_stage == 3, "model.lora.rank > 0 with engine.zero_stage=3",
                "engine.zero_stage=2 (or full fine-tuning)"),
               (lora.rank > 0 and engine.sequence_parallel_size > 1,
                "model.lora.rank > 0 with engine.sequence_parallel_size>1", "engine.sequence_parallel_size=1"),
               (lora.quantize_base != "none", f"model.lora.quantize_base={lora.quantize_base}",
                "model.lora.quantize_base=none (LoRA on the unquantised model)"),
               (lora.use_dora, "model.lora.use_dora=true", "model.lora.use_dora=false (plain LoRA)")]
    for bad, setting, instead in refused:
        if bad:
            raise UserInputError(f"model.path={config.model.path} is a vision-language model, which hpsft does not "
                                 f"train with {setting} yet (docs/vision.md): use {instead}")


def check_model_settings(config: SFTConfig, folder_config) -> None:
    """What the model folder (its transformers config `folder_config`) cannot be trained with, refused by name."""
    if has_vision_tower(folder_config):
        check_vision_layout(config)
    elif config.model.freeze_vision:
        raise UserInputError(f"model.freeze_vision=true: {config.model.path} has no vision tower to freeze; "
                             "remove model.freeze_vision")


class SFTTrainer:
    # The kind of run, recorded in its checkpoints for the resume message (either kind resumes the other's).
    checkpoint_mode = "spmd"

    def __init__(self, config: SFTConfig):
        self.config = config
        model = config.model
        # Read once per run; what the model cannot take is refused before any rank, worker or data starts.
        self.model_config = model_config(check_model_path(model.path, model.trust_remote_code),
                                         model.trust_remote_code)
        check_model_settings(config, self.model_config)
        # A vision-language model's image processor: its rows' images go into the store too.
        processor = (load_image_processor(model.path, model.trust_remote_code) if has_vision_tower(self.model_config)
                     else None)
        self.mesh = self.build_mesh()  # handed to the worker (and its engine): nothing else counts ranks
        self.rank = distributed.rank()  # 0 on a Ray driver, outside torch.distributed
        if self.rank == 0:
            print(f"hpsft: {self.launch_description()}{self.mesh_description()}", flush=True)
        self.run_dir = Path(config.trainer.output_dir)
        self.check_output_dir()
        distributed.on_rank0_then_share(lambda: check_trackers_available(config))  # rank 0 logs
        world_size = self.mesh.world_size
        if config.trainer.profile_steps and max(config.trainer.profile_ranks, default=0) >= world_size:
            raise UserInputError(f"trainer.profile_ranks={list(config.trainer.profile_ranks)} names a rank the run "
                                 f"does not have: its ranks are 0..{world_size - 1}")
        engine_class(config.engine.name)  # an unknown engine stops the run before the data is prepared
        seed_everything(config.trainer.seed)
        data = config.data
        if data.train_batch_size % self.mesh.dp_size:
            raise UserInputError(
                f"data.train_batch_size={data.train_batch_size} is not divisible by the "
                f"{self.mesh.dp_size} data-parallel ranks"
            )
        # Sequences this process loads per step (its data-parallel share under SPMD, the same for
        # every rank of a replica; all of them on a Ray driver).
        self.batch_per_rank = data.train_batch_size // self.mesh.loading_ranks

        self.tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
        if data.chat_template is not None:  # also what the exported tokenizer carries
            self.tokenizer.chat_template = chat_template_text(data.chat_template)
        runner = self.build_data_runner() if data.custom_cls.path is None else None
        report, bar = self.rank == 0, config.trainer.progress_bar
        self.train_dataset = build_dataset(data.train_sources(), self.tokenizer, data, runner, report, bar, processor)
        self.val_dataset = (build_dataset(data.val_sources(), self.tokenizer, data, runner, report, bar, processor)
                            if data.val_files else None)
        self.sequence_cost = self.build_sequence_cost()  # the sampler's, and on Ray the driver's split
        self.train_loader = self.build_train_loader()
        self.total_steps = self.count_total_steps()
        # Rank 0 records it in every checkpoint and checks a resumed one against it.
        self.fingerprint = run_fingerprint(config, self.tokenizer) if self.rank == 0 else None
        self.checkpoints = CheckpointManager(self.run_dir)
        resume_from = self.find_checkpoint()

        self.worker: Worker = self.build_worker()
        self.skipped_steps = SkippedSteps(config.trainer.max_skipped_steps)
        self.faults = InjectedFaults.from_environment()  # the tests' save pauses: none in real runs

        # Everything that can fail on bad input has run: only now does the run directory appear
        # (and a previous run's outputs go, when the user asked for that).
        if self.rank == 0:
            if config.trainer.overwrite_output_dir:
                clear_previous_run(self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(config))
        distributed.barrier()
        self.global_step, self.epoch = 0, 0
        self.samples_in_epoch = 0  # of the epoch's global sample order, consumed by finished steps
        self.last_checkpoint: Path | None = None  # the newest this run saved or resumed from
        self.profiling = False  # inside trainer.profile_steps, the worker's profiler running
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        self.tracker = Tracker(config, self.run_dir, self.global_step) if self.rank == 0 else None

    def build_mesh(self) -> distributed.Mesh:
        """This process's place in the run's layout (after joining torch.distributed): every
        data-parallel rank loads its share of each global batch."""
        engine = self.config.engine
        distributed.init_distributed(engine.dist_backend, engine.collective_timeout_s)
        return distributed.mesh(engine)

    def launch_description(self) -> str:
        return distributed.launch_description()

    def mesh_description(self) -> str:
        """The layout of the ranks, when there is more than data parallelism: its sizes (PP and EP
        when > 1) and, with tensor, pipeline or expert parallelism, every rank's coordinates
        (computed: the layout is fixed)."""
        mesh = self.mesh  # the world: this process's, or a Ray driver's workers
        if max(mesh.tp_size, mesh.pp_size, mesh.ep_size) > 1:
            ranks = "; ".join(mesh.at(r).coordinates() for r in range(mesh.world_size))
            return f"; mesh {mesh.description()}; {ranks}"
        if mesh.sp_size > 1:
            return f"; data-parallel size {mesh.dp_size} x sequence-parallel size {mesh.sp_size}"
        return ""

    def worker_args(self) -> tuple:
        """TrainingWorker's constructor arguments, alike in this process and in a Ray actor."""
        config = self.config
        return (config.model, config.loss, config.engine, config.optim, config.data, self.total_steps, self.mesh,
                config.trainer.peak_flops_per_device, config.trainer.seed)

    def build_worker(self) -> Worker:
        worker = TrainingWorker(*self.worker_args())
        worker.init_model()
        return worker

    def build_data_runner(self):
        """Who tokenizes what is not prepared yet: this process's worker processes, and under
        SPMD the ranks that share the cache folder, each its share of the shards."""
        data = self.config.data
        num_proc = data.num_proc or default_num_proc()
        if distributed.world_size() == 1:
            return LocalRunner(num_proc)
        cache = Path(data.cache_dir)
        make_cache_folder(cache, cache)
        team, attempt = distributed.ranks_sharing(cache)
        if self.rank == 0 and len(team) < distributed.world_size():
            print(f"hpsft: data.cache_dir {cache} is not shared by all {distributed.world_size()} ranks (rank 0 "
                  f"shares it with ranks {team}): each group of ranks that shares one prepares all of the data",
                  flush=True)
        return TeamRunner(Team(self.rank, team.index(self.rank), len(team), attempt), num_proc)

    def build_sequence_cost(self) -> SequenceCost:
        """How each step's split over the data-parallel ranks weighs a sequence."""
        config = self.model_config
        hidden = config.get_text_config().hidden_size if self.config.data.balance == "attention" else None
        # A vision model's images cost their tower's work too (the image tokens count as decoder tokens already).
        return SequenceCost(hidden, VisionTowerCost(config) if has_vision_tower(config) else None)

    def build_sampler(self) -> StepBatchSampler:
        """This process's part of each step's global batch: the SPMD rank's share by cost, or
        the whole batch on the Ray driver (its worker group splits it by the same cost)."""
        data = self.config.data
        return StepBatchSampler(self.train_dataset, data.mixture_weights(), data.train_batch_size, self.mesh.data_part,
                                self.mesh.loading_ranks, data.shuffle, self.config.trainer.seed, self.sequence_cost)

    def build_train_loader(self) -> DataLoader:
        self.sampler = self.build_sampler()
        # The device this process trains on (under SPMD its engine's: init_distributed set it;
        # a Ray driver's own, its workers' engines elsewhere).
        feed = device_feed(distributed.comm_device())
        loader = DataLoader(self.train_dataset, batch_sampler=self.sampler, collate_fn=collate_jagged,
                            **loader_options(feed, self.config.data.num_workers))
        if len(loader) == 0:
            raise UserInputError(
                f"{len(self.train_dataset)} training sequences make no full batch of "
                f"data.train_batch_size={self.config.data.train_batch_size}"
            )
        return loader

    def count_total_steps(self) -> int:
        """trainer.total_steps when set (epochs repeat as needed), else epochs x steps/epoch."""
        if self.config.trainer.total_steps is not None:
            return self.config.trainer.total_steps
        return self.config.trainer.total_epochs * len(self.train_loader)

    # ---- checkpoints -------------------------------------------------------------------

    def check_output_dir(self) -> None:
        """Before anything slow: the output_dir can be written, and a fresh run does not mix
        into another run's outputs."""
        trainer_cfg = self.config.trainer

        def problem():
            fresh = trainer_cfg.resume == "disable"
            return unwritable_problem(self.run_dir) or (
                fresh_start_problem(self.run_dir, trainer_cfg.overwrite_output_dir) if fresh else None)

        found = distributed.on_rank0_then_share(problem)
        if found is not None:
            raise UserInputError(found)

    def find_checkpoint(self) -> Path | None:
        """The checkpoint to resume from (None: start afresh), checked before the model is built."""
        mode = self.config.trainer.resume
        if mode == "disable":
            return None
        find = self.checkpoints.latest if mode == "auto" else lambda: CheckpointManager.resolve(mode)

        def find_and_check():
            checkpoint = find()
            if checkpoint is not None:
                self.check_fingerprint(checkpoint)
            return checkpoint

        # Rank 0 checks the manifests and fingerprint and reports once; all load its choice.
        return distributed.on_rank0_then_share(find_and_check)

    def check_fingerprint(self, checkpoint: Path) -> None:
        """Refuse a checkpoint of a different run (see hpsft/trainer/fingerprint.py)."""
        recorded = CheckpointManager.load_run_fingerprint(checkpoint)
        if recorded is None:
            warn(f"checkpoint {checkpoint} has no {RUN_FINGERPRINT} (written by an older hpsft): "
                 "not checked against this run's model, data and batch size")
            return
        changed = differences(recorded, self.fingerprint)
        if not changed:
            return
        if self.config.trainer.resume_force:
            warn(f"resuming from {checkpoint} with trainer.resume_force=true although the run differs: "
                 + "; ".join(changed))
            return
        raise UserInputError(
            f"checkpoint {checkpoint} belongs to a different run: {'; '.join(changed)}. Resume with the run's "
            "settings, start a new run in another trainer.output_dir, or set trainer.resume_force=true to "
            "continue from it anyway"
        )

    def load_checkpoint(self, checkpoint: Path) -> None:
        """Any checkpoint of this run, whatever the data-parallel size and kind (SPMD or Ray)
        that wrote it: the engine reshards its state, the data position is in samples."""
        state = CheckpointManager.load_trainer_state(checkpoint)
        batch_size = self.config.data.train_batch_size
        if state["samples_in_epoch"] % batch_size:
            raise UserInputError(
                f"{checkpoint} stopped after sample {state['samples_in_epoch']} of epoch {state['epoch']}, "
                f"not a whole number of steps of data.train_batch_size={batch_size}: resume with the "
                "batch size of the run that wrote it"
            )
        self.worker.load_checkpoint(str(checkpoint.parent), checkpoint.name)
        self.global_step, self.epoch = state["global_step"], state["epoch"]
        self.samples_in_epoch = state["samples_in_epoch"]
        self.skipped_steps.total = state["skipped_steps"]
        set_rng_state(state["rng"])
        self.last_checkpoint = checkpoint
        if self.rank == 0:
            print(f"resumed from {checkpoint} at step {self.global_step} (written by a {state['mode']} run "
                  f"with {state['dp_size']} data-parallel ranks, now {self.mesh.dp_size})", flush=True)

    def save_checkpoint(self) -> None:
        step = self.global_step
        self.worker.save_checkpoint(str(self.checkpoints.root), self.checkpoints.partial_tag(step))
        if self.rank == 0:  # the state of the whole run: the same on every rank
            self.checkpoints.save_trainer_state(step, {
                "global_step": step,
                "epoch": self.epoch,
                "samples_in_epoch": self.samples_in_epoch,
                "mode": self.checkpoint_mode,  # what wrote it (any kind of run may resume it)
                "dp_size": self.mesh.dp_size,
                "tp_size": self.mesh.tp_size,
                "sp_size": self.mesh.sp_size,
                "pp_size": self.mesh.pp_size,
                "ep_size": self.mesh.ep_size,
                "skipped_steps": self.skipped_steps.total,
                "rng": rng_state(),
            })
            self.checkpoints.save_run_fingerprint(step, self.fingerprint)
        self.faults.pause_in_save("written", self.rank)
        distributed.barrier()
        if self.rank == 0:
            self.checkpoints.commit(step)
            self.checkpoints.prune(self.config.trainer.keep_last_checkpoints, step)
        self.faults.pause_in_save("committed", self.rank)
        distributed.barrier()
        self.faults.pause_in_save("saved", self.rank)
        self.last_checkpoint = self.checkpoints.root / CheckpointManager.tag(step)

    # ---- loop --------------------------------------------------------------------------

    def validate(self) -> dict:
        """val/loss: the token-mean NLL over the whole validation set (every sequence exactly
        once; with sequence parallelism each SP rank adds its slices' share of it); with several
        validation sources also val/loss/<name> over each one's tokens."""
        indices = list(range(self.mesh.data_part, len(self.val_dataset), self.mesh.loading_ranks))
        chunks = [indices[i:i + self.batch_per_rank] for i in range(0, len(indices), self.batch_per_rank)]
        n_chunks = distributed.all_reduce_max(len(chunks))
        names = self.val_dataset.names
        nll_sums = torch.zeros(len(names), dtype=torch.float64)
        loss_tokens = torch.zeros(len(names), dtype=torch.float64)
        for i in range(n_chunks):
            batch = collate_jagged([self.val_dataset[j] for j in chunks[i]]) if i < len(chunks) else empty_batch()
            out = self.worker.infer_batch(batch)
            nll_sums.index_add_(0, batch["source"], out["nll_sum"].double())
            loss_tokens.index_add_(0, batch["source"], out["loss_tokens"].double())
        totals = distributed.all_reduce_sum(nll_sums.tolist() + loss_tokens.tolist())
        nll_sums, loss_tokens = totals[:len(names)], totals[len(names):]
        metrics = {"val/loss": sum(nll_sums) / max(sum(loss_tokens), 1.0)}
        if len(names) > 1:
            metrics.update({f"val/loss/{name}": nll / max(tokens, 1.0)
                            for name, nll, tokens in zip(names, nll_sums, loss_tokens)})
        return metrics

    def step_metrics(self, out: StepResult, step_time: float) -> dict:
        total = out.all_reduced()  # a no-op on the Ray driver, whose worker combined the ranks
        per_token = 1.0 / max(total.loss_tokens, 1.0)
        # train/loss is the plain NLL; every other term of the objective has its own name.
        optional = {}
        if self.config.loss.z_loss_weight:
            optional["train/z_loss"] = total.z_loss_sum * per_token
        if total.router_aux_loss_sum:
            optional["train/router_aux_loss"] = total.router_aux_loss_sum * per_token
        if self.config.loss.z_loss_weight or self.config.loss.label_smoothing or total.router_aux_loss_sum:
            optional["train/objective"] = total.objective_sum * per_token
        if self.config.loss.token_accuracy:
            optional["train/token_accuracy"] = total.correct_tokens * per_token
        names = self.train_dataset.names
        if len(names) > 1:  # a source without loss tokens in this step has no loss to report
            for name, nll_sum, tokens in zip(names, total.source_nll_sums, total.source_loss_tokens):
                if tokens:
                    optional[f"train/loss/{name}"] = nll_sum / tokens
                    optional[f"train/loss_tokens/{name}"] = int(tokens)
        return {
            **optional,
            "train/loss": total.nll_sum * per_token,
            "train/grad_norm": total.grad_norm,
            "train/lr": total.lr,
            "train/loss_tokens": int(total.loss_tokens),
            "train/tokens": int(total.tokens),
            "perf/tokens_per_s": total.tokens / step_time,
            "perf/padding_efficiency": total.tokens / max(total.computed_tokens, 1.0),
            "perf/micro_batches_per_rank": total.micro_batches,
            "perf/mfu": total.flops / step_time / total.peak_flops,  # peak: the sum of the devices' peaks
            "perf/step_time_s": step_time,
            "perf/rss_anon_gib": total.rss_anon_bytes / 2**30,  # the largest rank's, after the step
            "train/epoch": self.epoch,
        }

    def batches(self):
        """Training batches from the current position to total_steps, across epochs."""
        while True:
            self.sampler.set_position(self.epoch, self.samples_in_epoch)
            for batch in self.train_loader:
                self.samples_in_epoch += self.config.data.train_batch_size
                yield batch
            self.epoch, self.samples_in_epoch = self.epoch + 1, 0

    def train_step(self, batch) -> StepResult:
        return self.worker.train_batch(batch, self.worker.global_loss_tokens(batch))

    def profile_before_step(self) -> None:
        """Start the profiler at the first step of trainer.profile_steps this run makes (a run
        resumed inside the range profiles the rest of it)."""
        steps = self.config.trainer.profile_steps
        if steps and not self.profiling and steps[0] <= self.global_step + 1 <= steps[1]:
            self.worker.start_profiler(str(self.run_dir / "profile"), list(self.config.trainer.profile_ranks),
                                       self.global_step + 1)
            self.profiling = True

    def profile_after_step(self) -> None:
        if self.profiling and self.global_step == self.config.trainer.profile_steps[1]:
            self.stop_profiler()

    def stop_profiler(self) -> None:
        self.worker.stop_profiler()
        self.profiling = False
        if self.rank == 0:
            print(f"hpsft: profile of steps {list(self.config.trainer.profile_steps)} written to "
                  f"{self.run_dir / 'profile'}", flush=True)

    def fit(self) -> None:
        trainer_cfg = self.config.trainer
        progress = progress_bar(self.rank == 0 and trainer_cfg.progress_bar, total=self.total_steps,
                                initial=self.global_step, desc="train", unit="step")
        last_step = min(self.total_steps, trainer_cfg.stop_at_step or self.total_steps)
        if trainer_cfg.val_before_train and self.global_step == 0 and self.val_dataset is not None:
            val_metrics = self.validate()  # where the curve starts: the model before any update
            if self.tracker:
                self.tracker.log(val_metrics, 0)
        batches = self.batches()
        preempted = False
        with PreemptionWatch() as preemption:
            while self.global_step < last_step and not preempted:
                batch = next(batches)
                self.profile_before_step()
                start = time.perf_counter()
                out = self.train_step(batch)
                self.global_step += 1
                metrics = self.step_metrics(out, time.perf_counter() - start)
                self.profile_after_step()  # after the step's time is taken: writing the trace is slow
                self.skipped_steps.record(out.grad_norm)  # the same global norm on every rank
                metrics["train/skipped_steps"] = self.skipped_steps.total
                progress.update(1)
                progress.set_postfix(step_postfix(metrics))
                preempted = preemption.stop_agreed()  # yes: stop signals ignored from here to the exit
                final = self.global_step == last_step
                if self.val_dataset is not None and not preempted and (
                        trainer_cfg.val_every and self.global_step % trainer_cfg.val_every == 0 or final):
                    metrics.update(self.validate())
                if self.tracker and (self.global_step % trainer_cfg.log_every == 0 or "val/loss" in metrics
                                     or final or preempted):
                    self.tracker.log(metrics, self.global_step)
                self.skipped_steps.check(self.global_step, self.last_checkpoint)
                if trainer_cfg.save_every and self.global_step % trainer_cfg.save_every == 0 or final or preempted:
                    self.save_checkpoint()
            progress.close()
            if self.profiling:  # the run stopped inside trainer.profile_steps (stop_at_step, a signal)
                self.stop_profiler()
            if self.tracker:
                self.tracker.close()
            if preempted:
                raise Preempted(self.global_step, self.last_checkpoint)
        if trainer_cfg.export_hf and self.global_step == self.total_steps:
            self.worker.export_hf(str(self.run_dir / "hf"), self.tokenizer, progress=trainer_cfg.progress_bar)
            distributed.barrier()
