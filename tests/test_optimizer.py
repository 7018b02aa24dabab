"""The engine's optimizer: torch's fused AdamW (on CPU checked against AdamW written out in fp64),
and the settings a GPU run gets (fused AdamW, ZeRO's communication overlap and buckets)."""

import pytest
import torch

from hpsft.config.schema import EngineConfig, OptimConfig
from hpsft.engine.deepspeed import DeepSpeedEngine
from hpsft.engine.deepspeed.config import GPU_ZERO_COMMUNICATION
from hpsft.engine.grad_norm import global_grad_norm
from hpsft.utils.distributed import Mesh
from tests.conftest import REPO, run_cli, write_tiny_llama
from tests.numerics import adamw_fp64_step


def adamw_fp64(params, grads_per_step, lr, betas, eps, weight_decays):
    """Loshchilov & Hutter's AdamW (decoupled decay, bias-corrected moments) over the steps, in fp64."""
    params = [p.double().clone() for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for p, g, state, wd in zip(params, grads, moments, weight_decays):
            adamw_fp64_step(p, g, state, t, lr, betas, eps, wd)
    return params


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU choice of optimizer")
def test_cpu_optimizer_is_fused_adamw_and_matches_the_fp64_reference():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 1000))
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
    optimizer = DeepSpeedEngine(EngineConfig(), optim, total_steps=10, mesh=Mesh(dp_size=1)).build_optimizer(module)
    assert type(optimizer) is torch.optim.AdamW and all(group["fused"] for group in optimizer.param_groups)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    weight_decays = [group["weight_decay"] for group in optimizer.param_groups for _ in group["params"]]
    assert sorted(set(weight_decays)) == [0.0, 0.1]  # biases and norms undecayed
    start = [p.detach().clone() for p in params]
    # Gradients of very different scales, some tiny (where eps matters), over three steps.
    grads_per_step = [[torch.randn_like(p) * 10.0 ** torch.randint(-9, 2, p.shape) for p in params] for _ in range(3)]
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
    expected = adamw_fp64(start, grads_per_step, optim.lr, optim.betas, optim.eps, weight_decays)
    for actual, reference in zip(params, expected):
        torch.testing.assert_close(actual.detach().double(), reference, rtol=1e-5, atol=1e-6)


def test_a_gpu_run_gets_fused_adamw_and_overlapped_zero_communication():
    """What the engine builds for a GPU run, read on CPU (on_cuda=True is what
    torch.cuda.is_available() sets there): torch's fused AdamW (planted: the previous
    fused=None on CUDA, torch's foreach default, fails it), ZeRO 1-3 with overlap_comm,
    contiguous gradients and 2e8-element buckets (planted: the settings dropped fails it), and
    none of them on CPU or without ZeRO."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    for on_cuda in (True, False):
        for stage in (0, 1, 2, 3):
            # Two ranks: in one process fp32 ZeRO-1/2 runs without ZeRO (zero_stage_to_run).
            engine = DeepSpeedEngine(EngineConfig(zero_stage=stage), OptimConfig(), total_steps=10, mesh=Mesh(dp_size=2))
            engine.on_cuda = on_cuda
            optimizer = engine.build_optimizer(module)
            assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
            zero = engine.deepspeed_config()["zero_optimization"]
            expected = GPU_ZERO_COMMUNICATION if on_cuda and engine.stage > 0 else {}
            assert {key: zero[key] for key in GPU_ZERO_COMMUNICATION if key in zero} == expected, (on_cuda, stage)
    assert GPU_ZERO_COMMUNICATION == {"overlap_comm": True, "contiguous_gradients": True,
                                      "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000}
    # ZeRO-Offload on a GPU machine steps on the CPU: DeepSpeed's CPU Adam, not torch's.
    engine = DeepSpeedEngine(EngineConfig(zero_stage=2, offload_optimizer=True), OptimConfig(), total_steps=10,
                             mesh=Mesh(dp_size=2))
    engine.on_cuda = True
    assert engine.deepspeed_config()["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_the_gradient_norm_is_fp64_accurate():
    """The norm the engine reports and clips by without ZeRO, against fp64, on gradients of
    an embedding's size (torch's own fp32 norm of such a CPU tensor is off by ~1e-3),
    of sizes that are no multiple of its block, and of none at all; NaN and Inf come through."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(28_311_552, generator=g) * 1e-3, torch.randn(576, 1537, generator=g), torch.randn(3, generator=g),
             torch.tensor(2.5)]
    reference = torch.sqrt(sum(torch.sum(grad.double() ** 2) for grad in grads))
    norm = global_grad_norm(grads)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), reference, rtol=1e-7, atol=0)
    assert float(global_grad_norm([])) == 0.0
    for bad in (float("nan"), float("inf")):
        grads[1][7, 9] = bad
        assert not torch.isfinite(global_grad_norm(grads))


def test_engine_steps_equal_plain_torch_adamw_with_clipping(tmp_path):
    """Three clipped steps of the engine against the same steps in plain PyTorch (single-tensor
    AdamW, clip_grad_norm_): the same gradient norms and weights, whatever the engine's
    optimizer, clipping and gradient buffers do. The default engine.zero_stage=2 runs without
    ZeRO in one process (zero_stage_to_run); DeepSpeed's stages 1 and 2, which it runs on more
    ranks, are forced here."""
    model = write_tiny_llama(tmp_path / "tiny-llama")
    out = tmp_path / "runs.pt"
    proc = run_cli(None, [str(model), str(out), "default,ds1,ds2"],
                   script=str(REPO / "tests" / "dist_scripts" / "engine_steps_vs_torch.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = torch.load(out)
    reference = runs.pop("torch")
    assert {name: run["deepspeed_stage"] for name, run in runs.items()} == {"default": 0, "ds1": 1, "ds2": 2}
    assert all(norm > 0.5 for norm in reference["grad_norms"])  # the clip (0.5) binds at every step
    for name, run in runs.items():
        torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(reference["grad_norms"]),
                                   rtol=1e-5, atol=0, msg=name)
        assert run["weights"].keys() == reference["weights"].keys()
        for param, weight in run["weights"].items():
            # atol: lr / 100. Where a gradient is ~0, Adam's m / sqrt(v) turns its rounding into
            # an update of up to lr; a missing or wrong clip moves every weight by ~lr / 10.
            torch.testing.assert_close(weight, reference["weights"][param], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name} {param}: {m}")
