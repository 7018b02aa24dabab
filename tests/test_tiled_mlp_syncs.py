"""A tiled MLP outside ZeRO-3 decides its tile count on the host: no collective and no wait for
the device per layer and micro-batch (it used to all-reduce the count and read it back with
.item() in every layer)."""

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from hpsft.models.tiled_mlp import TileCount, tiled_forward
from tests.syncing_ops import DataDependentOps


def test_a_tiled_mlp_without_zero3_needs_no_device_data_on_the_host():
    """Forward and backward of a LlamaMLP in tiles of 8 over 57 tokens: the untiled output and
    gradients (1e-6), ceil(57 / 8) = 8 tiles, and no syncing op recorded. Planted: the old
    agreed_tiles (a tensor read back with .item() on every call) fails the record."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64)
    mlp = LlamaMLP(config)
    x = torch.randn(1, 57, 32, requires_grad=True)
    reference = mlp(x)
    reference.square().sum().backward()
    expected_grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    calls = []
    mlp.up_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[-2]))
    mlp.forward = tiled_forward(mlp.forward, TileCount(8)).__get__(mlp)
    with DataDependentOps() as ops:
        out = mlp(x)
        out.square().sum().backward()
    assert ops.seen == [], ops.seen
    assert calls == ([8] + [7] * 7) * 2  # forward, then recomputed in backward
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    for actual, expected in zip([x.grad] + [p.grad for p in mlp.parameters()], expected_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
