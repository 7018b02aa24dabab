"""The DeepSpeed config the engine runs with, from the `engine` and `optim` sections.

The number of micro-batches varies from step to step (token-budget batching), so the config
says one micro-batch per step and the engine sets the accumulation boundary by hand before
every backward (engine.py).
"""

# ZeRO 1-3 on GPUs (docs/performance.md, "GPU: communication"): stage 2 reduces each bucket of
# gradients on a side stream while backward goes on (DeepSpeed's default for stages 1-2 is to
# wait for it; stage 3 overlaps already); gradients copied into one contiguous buffer as they
# arrive; buckets of 2e8 elements (fp32: 800 MB; DeepSpeed's default 5e8), what common
# DeepSpeed setups use, so that the first reduction starts earlier in backward. bf16 ZeRO-1
# runs DeepSpeed's BF16_Optimizer, which reads only allgather_bucket_size of these.
GPU_ZERO_COMMUNICATION = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 200_000_000,
                          "allgather_bucket_size": 200_000_000}


def zero_stage_to_run(engine_config, one_process: bool) -> int:
    """The stage DeepSpeed runs: engine.zero_stage, except that fp32 ZeRO-1/2 in one process
    runs without ZeRO. There ZeRO has nothing to partition, yet DeepSpeed's stage-1/2
    optimizer copies every gradient into its bucket and flat partition, flattens them
    again in step(), takes the norm over per-parameter views and copies the fp32 master
    weights back: ~1.6 s a step on SmolLM2-135M, 15-20 % of a 500-token step
    (docs/performance.md). Checkpoints then hold the whole AdamW state in one file; a run
    with ZeRO resumes them, and this one resumes ZeRO checkpoints, through DeepSpeed's
    universal layout (checkpoint.py). bf16 keeps its stage: its fp32 gradient
    accumulation and master weights are ZeRO's (docs/precision.md)."""
    if (engine_config.zero_stage in (1, 2) and one_process and engine_config.dtype == "float32"
            and not engine_config.offload_optimizer):
        return 0
    return engine_config.zero_stage


def deepspeed_config(engine_config, optim_config, stage: int, tp_size: int, on_cuda: bool) -> dict:
    """DeepSpeed's config for ZeRO stage `stage` and AutoTP over `tp_size` ranks; `on_cuda`: with
    the GPU-only settings."""
    zero = {"stage": stage}
    if on_cuda and stage > 0:
        zero.update(GPU_ZERO_COMMUNICATION)
    if engine_config.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    if engine_config.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
    tensor_parallel = {"tensor_parallel": {"autotp_size": tp_size}} if tp_size > 1 else {}
    return tensor_parallel | {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # Without ZeRO the engine clips by the norm it reports (clip_unsharded_grads):
        # DeepSpeed's own clipping would take the norm a second time, plus a collective.
        "gradient_clipping": optim_config.grad_clip if stage > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": engine_config.dtype == "bfloat16"},
        # bf16 weights and activations, but gradients accumulated over micro-batches and
        # reduced over ranks in fp32 into fp32 master weights (DeepSpeed's default would do
        # both in bf16); docs/precision.md has what each ZeRO stage does with these.
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        # We pass a torch AdamW: no JIT-built fused/cpu Adam op is needed on CPU machines.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
