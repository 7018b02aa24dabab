"""The data stage on a Ray cluster: the driver runs the shards to prepare as Ray tasks, one
CPU each, over the cluster's CPUs (hpsft/data/preparation.py says what a shard is). The
driver waits for them with ray.wait, shard by shard, with progress and no timeout; a task
that fails stops the run with its error (a bad row names its file and row). The store folder
must be one every node sees (data.cache_dir on a shared file system)."""

import ray

from hpsft.data.preparation import ShardJob, init_worker, prepare_shard
from hpsft.data.rows import DataError


def prepare_shard_task(job: ShardJob, tokenizer, opts, processor=None) -> dict:
    init_worker(tokenizer, opts, processor)
    return prepare_shard(job)


class RayTaskRunner:
    def __init__(self, cpus_per_task: float = 1.0):
        self.task = ray.remote(num_cpus=cpus_per_task, max_retries=0)(prepare_shard_task)

    def run(self, jobs: list[ShardJob], tokenizer, opts, progress, processor=None) -> None:
        tokenizer_ref = ray.put(tokenizer)
        pending = [self.task.remote(job, tokenizer_ref, opts, processor) for job in jobs]
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    progress.add(ray.get(done[0]))
                except ray.exceptions.RayTaskError as err:
                    if isinstance(err.cause, DataError):  # a bad row: its one-line message
                        raise err.cause from None
                    raise
        finally:
            for ref in pending:
                ray.cancel(ref)
