"""RaySFTTrainer: the SPMD trainer's builder sequence, fit(), validation, checkpoints,
resume, tracking and progress bar, run by one driver over a RayWorkerGroup.

The driver is a single process outside torch.distributed (rank 0 of a world of one): it
loads whole global batches (the same sequences per step as the SPMD ranks together) and
hands them to DataParallelWorker, which shards them over the group's data-parallel ranks
(the workers' Mesh, distributed.workers_mesh). A tensor-parallel group is TP consecutive ranks
of one node: TP must divide ray.n_workers_per_node. Checkpoints: the
workers write their engine shards, the driver the trainer state (step, data position in
samples, RNG), as SPMD's rank 0 does: either kind of run resumes the other's. A lost worker
(dead, or hung past ray.call_timeout_s) stops the run with an error naming its rank; with
ray.max_restarts > 0 the driver builds a new group and goes on from the last checkpoint,
and a group lost while being rebuilt uses up a restart too.
"""

from hpsft.config import SFTConfig
from hpsft.ray.data_parallel import DataParallelWorker
from hpsft.ray.data_preparation import RayTaskRunner
from hpsft.ray.resource_pool import RayResourcePool
from hpsft.ray.worker_group import ClassWithInitArgs, RayWorkerGroup, WorkerLostError
from hpsft.trainer.rng import seed_everything
from hpsft.trainer.sft_trainer import SFTTrainer
from hpsft.utils.distributed import Mesh, workers_mesh
from hpsft.workers import TrainingWorker


class RaySFTTrainer(SFTTrainer):
    checkpoint_mode = "ray"

    def __init__(self, config: SFTConfig):
        self.group: RayWorkerGroup | None = None  # the workers behind self.worker, once built
        try:
            super().__init__(config)
        except BaseException:  # e.g. a bad resume path after the group started: free the workers
            self.close()
            raise

    def build_mesh(self) -> Mesh:
        """The workers' layout; the driver is outside it (rank None) and loads whole global
        batches for their data-parallel ranks."""
        return workers_mesh(self.config.ray, self.config.engine)

    def launch_description(self) -> str:
        ray_cfg = self.config.ray
        return (f"launcher ray: world size {self.mesh.world_size}, {ray_cfg.nnodes} node(s), "
                f"{ray_cfg.n_workers_per_node} rank(s) per node")

    def build_data_runner(self) -> RayTaskRunner:
        return RayTaskRunner()

    def build_worker(self) -> DataParallelWorker:
        cfg = self.config
        pool = RayResourcePool(cfg.ray.nnodes, cfg.ray.n_workers_per_node, cfg.ray.cpus_per_worker,
                               cfg.ray.placement_timeout_s)
        worker = ClassWithInitArgs(TrainingWorker, self.worker_args())
        group = self.group = RayWorkerGroup(pool, worker, cfg.engine.dist_backend, cfg.trainer.seed,
                                            cfg.ray.call_timeout_s, cfg.engine.collective_timeout_s)
        print("hpsft: ray worker group:\n  " + "\n  ".join(group.placement_lines()), flush=True)
        if self.mesh.tp_size > 1:
            print("hpsft: tensor-parallel groups, each on one node:\n  "
                  + "\n  ".join(group.node_groups(self.mesh.groups("tp"))), flush=True)
        group.init_model().get()
        return DataParallelWorker(group, self.mesh, self.sequence_cost)

    def fit(self) -> None:
        restarts = 0
        while True:
            try:
                if self.worker is None:  # the last group was lost: a new one, from the last checkpoint
                    self.worker = self.build_worker()
                    self.go_back_to_last_checkpoint()
                return super().fit()
            except WorkerLostError as err:  # the group has already killed its other ranks
                self.worker = None
                self.profiling = False  # a profiler of the lost group went with it (the new one starts anew)
                if restarts == self.config.ray.max_restarts:
                    raise
                restarts += 1
                print(f"{err}\nrestart {restarts}/{self.config.ray.max_restarts}: new worker group, "
                      f"resuming from {self.last_checkpoint or 'the start'}", flush=True)

    def go_back_to_last_checkpoint(self) -> None:
        if self.last_checkpoint is not None:
            self.load_checkpoint(self.last_checkpoint)
            return
        seed_everything(self.config.trainer.seed)
        self.global_step, self.epoch, self.samples_in_epoch = 0, 0, 0
        self.train_loader = self.build_train_loader()

    def close(self) -> None:
        """Free the workers and their placement groups (the Ray instance stays; idempotent)."""
        if self.group is not None:
            self.group.shutdown()
