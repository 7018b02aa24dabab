"""The CUDA assumptions Megatron-Core 0.19 makes that stop it on CPU (gloo), bypassed here only.

`apply()` is called by model.py before Megatron builds or runs anything; it does nothing when
CUDA is available, and nothing the second time. Each bypass is one named function or
attribute, with the assumption it bypasses. Three are torch.cuda functions that, without
CUDA, raise ("Torch not compiled with CUDA enabled"), so only callers that would fail without
CUDA see the change (the transformers, DeepSpeed and torch callers read check
torch.cuda.is_available() first); they stay patched for the process's life. The rest are Megatron's own. Not bypassed, set instead (model.py):
the RNG trackers (model_parallel_cuda_manual_seed with inference_rng_tracker=True),
`use_cpu_initialization`, the fusions off, `batch_p2p_comm=False`.
"""

import functools

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def apply() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _applied = True

    # Megatron allocates with device=torch.cuda.current_device() throughout (the rotary
    # embedding's inv_freq, the MoE router's weight, p2p receive buffers, DDP's grad buffers,
    # the all-to-all's output, the global memory buffer): the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # DDP's grad sync makes torch.cuda.current_stream() wait on each parameter's CUDA-graph
    # event (there are none): a stream whose waits are no-ops.
    torch.cuda.current_stream = lambda device=None: CpuStream()
    # The pipeline's p2p calls exchange tensor shapes (variable_seq_lengths) by a batch of
    # isend/irecv and then torch.cuda.synchronize(), whatever batch_p2p_comm says: on the CPU
    # the requests' waits are the synchronisation.
    torch.cuda.synchronize = lambda device=None: None

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # Tied embeddings under PP: at construction the last stage's copy of the word embedding is
    # moved with .cuda() and all-reduced with the first stage's. hpsft never trains from that
    # initial value: convert.load_hf_weights writes the same Hugging Face tensor into both
    # copies (finalize_model_grads keeps their gradients summed).
    LanguageModule._is_in_embd_group = lambda self: False

    # The all-to-all MoE dispatcher makes a CUDA side stream at construction unless one exists
    # (a stand-in, never used: see splits_to_host)...
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on CPU"
    # ...on which it copies the token counts to the host, the all-to-all's split sizes as numpy
    # arrays; its copy helper converts CUDA tensors only, so on CPU the splits would reach
    # all_to_all_single as tensors, which it refuses.
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = splits_to_host

    # The schedules count the step's loss tokens in torch.zeros([], device="cuda") (a literal):
    # each runs with device="cuda" made the CPU. get_forward_backward_func returns these module
    # attributes by name.
    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving"):
        setattr(schedules, name, with_cuda_assumptions_on_cpu(getattr(schedules, name)))

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import (ChainedOptimizer, Float16OptimizerWithFloat16Params,
                                                   FP32Optimizer, MixedPrecisionOptimizer)

    # The optimizers allocate their flags, scales and norms with device="cuda" literals and
    # accept only parameters whose type() is "torch.cuda.FloatTensor" (or Half/BFloat16):
    # their construction and their steps (the gradient norm and clipping included) run with
    # device="cuda" made the CPU and a CPU tensor's type() named as its dtype's CUDA type.
    for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer, FP32Optimizer, ChainedOptimizer):
        cls.__init__ = with_cuda_assumptions_on_cpu(cls.__init__)
    for cls in (MixedPrecisionOptimizer, FP32Optimizer, ChainedOptimizer):
        cls.step = with_cuda_assumptions_on_cpu(cls.step)
    # The Megatron engine runs ChainedOptimizer.step's parts itself (engine.py: a non-finite
    # gradient norm skips the step): each under the same mode.
    for name in ("prepare_grads", "get_grad_norm", "step_with_ready_grads"):
        setattr(ChainedOptimizer, name, with_cuda_assumptions_on_cpu(getattr(ChainedOptimizer, name)))

    # Without Apex or Transformer Engine the optimizers' gradient norm is torch.norm of each
    # fp32 gradient, which on the CPU is a long running sum (hpsft/engine/grad_norm.py): 2.1e-5
    # relative off on the tiny tied Llama of the engine tests, beyond what the comparison with
    # the DeepSpeed engine allows. The same norm as hpsft's, blockwise in fp64.
    from megatron.core.optimizer import optimizer as optimizer_module

    optimizer_module.get_grad_norm_fp32 = accurate_grad_norm_fp32(optimizer_module.get_grad_norm_fp32)


def accurate_grad_norm_fp32(megatron_norm):
    """Megatron's get_grad_norm_fp32(grads, norm_type, grad_stats_parallel_group) with the 2-norm's
    sum of squares taken as hpsft's global_grad_norm takes it, all-reduced in fp64."""
    import torch.distributed as dist

    from hpsft.engine.grad_norm import square_sum

    @functools.wraps(megatron_norm)
    def norm(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if float(norm_type) != 2.0:
            return megatron_norm(grads_for_norm, norm_type, grad_stats_parallel_group)
        grads = [grads_for_norm] if torch.is_tensor(grads_for_norm) else list(grads_for_norm)
        total = square_sum(grads)
        dist.all_reduce(total, group=grad_stats_parallel_group)
        return float(total.sqrt())
    return norm


class CpuStream:
    """The CPU runs its work in order, as one stream: waiting on anything is a no-op."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


def splits_to_host(dispatcher, point: str, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize without CUDA: at the
    dispatcher's device-to-host point the split sizes become the numpy arrays the GPU path makes
    of them; the token counts stay tensors, as there; nothing to wait for."""
    if not dispatcher.drop_and_pad and point == dispatcher.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(dispatcher, name)
            if torch.is_tensor(value):
                setattr(dispatcher, name, value.numpy())
    return tokens_per_expert


class CudaAssumptionsOnCpu(TorchFunctionMode):
    """Within it, a torch call given device="cuda" runs on the CPU, and Tensor.type() of a CPU
    tensor answers its dtype's CUDA type ("torch.cuda.FloatTensor")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


_inside = 0  # how deep in with_cuda_assumptions_on_cpu calls this process is (one mode is enough)


def with_cuda_assumptions_on_cpu(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        global _inside
        if _inside:
            return function(*args, **kwargs)
        _inside += 1
        try:
            with CudaAssumptionsOnCpu():
                return function(*args, **kwargs)
        finally:
            _inside -= 1
    return run
