"""Tiled MLP (Arctic Long Sequence Training): each decoder layer's MLP runs over the row in
tiles of tokens, forward and backward, so its (tokens x intermediate_size) activations exist
for one tile at a time instead of the whole row.

The forward runs the tiles without keeping their graphs; the backward recomputes each tile
and takes its gradients (one more MLP forward per step), telling ZeRO to reduce the weights'
gradients after the last tile only (`ds_grad_is_ready`, as DeepSpeed's own TiledMLP does).
Unlike DeepSpeed 0.19.8's TiledMLP, which cuts with torch.chunk (fewer pieces than asked
when the row is short: ranks then disagree on the count, and the gradients of a cut with
fewer pieces are never marked ready), the row is cut with tensor_split into exactly the
agreed number of tiles, some possibly empty. Only the MLP instances of this model are
changed (their `forward`), never the class.
"""

import math
import types

import torch
import torch.distributed as dist

from hpsft.models.families import UnsupportedModel


class TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, x, tiles, params):
        ctx.forward, ctx.tiles, ctx.params = forward, tiles, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([forward(tile) for tile in x.tensor_split(tiles, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(x.requires_grad)
        grad_x = torch.zeros_like(x)
        x_tiles, grad_tiles = x.tensor_split(ctx.tiles, dim=-2), grad.tensor_split(ctx.tiles, dim=-2)
        grad_x_tiles = grad_x.tensor_split(ctx.tiles, dim=-2)
        for i, (tile, grad_tile, grad_x_tile) in enumerate(zip(x_tiles, grad_tiles, grad_x_tiles)):
            last = i == ctx.tiles - 1
            for param in ctx.params:  # ZeRO reduces a weight's gradient once it is complete
                param.ds_grad_is_ready = last
            tile = tile.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.forward(tile)
            torch.autograd.backward(out, grad_tile)
            if tile.grad is not None:
                grad_x_tile.copy_(tile.grad)
        return None, grad_x, None, None


def agreed_tiles(tokens: int, tile_tokens: int, device, partitioned: bool) -> int:
    """The tile count of this call. Under ZeRO-3 (`partitioned`: the MLP's weights are ZeRO-3
    parameters) the same on every rank: each tile's call of a projection gathers its weight,
    a collective that every rank must join as often, so the count is all-reduced (a wait for
    the device). Otherwise a host number, no collective and no sync: each rank reduces each
    weight's gradient once, after its own last tile, whatever its count."""
    tiles = max(math.ceil(tokens / tile_tokens), 1)
    if not (partitioned and dist.is_initialized() and dist.get_world_size() > 1):
        return tiles
    agreed = torch.tensor([tiles], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed.item())


class TileCount:
    """The tile count of one forward of the model: decided by its first layer's MLP and kept for
    the others, which see the same tokens (and for their recomputation under activation
    checkpointing), so that under ZeRO-3 a forward all-reduces it once, not once per layer.
    A forward pre-hook on the decoder forgets it (`forget`) before the next forward."""

    def __init__(self, tile_tokens: int):
        self.tile_tokens = tile_tokens
        self.tiles = None

    def forget(self, *_) -> None:
        self.tiles = None

    def of(self, tokens: int, device, partitioned: bool) -> int:
        if self.tiles is None:
            self.tiles = agreed_tiles(tokens, self.tile_tokens, device, partitioned)
        return self.tiles


def tiled_forward(original_forward, count: TileCount):
    def forward(self, x):
        params = [p for p in self.parameters() if p.requires_grad]
        partitioned = any(hasattr(p, "ds_id") for p in self.parameters())
        return TiledMLPFunction.apply(original_forward, x, count.of(x.shape[-2], x.device, partitioned), params)

    return forward


def tile_mlps(lm: torch.nn.Module, tile_tokens: int) -> None:
    """Make every decoder layer's MLP of `lm` run in tiles of `tile_tokens` tokens."""
    count = TileCount(tile_tokens)
    decoder = lm.get_decoder()
    decoder.register_forward_pre_hook(count.forget)
    for i, layer in enumerate(decoder.layers):
        mlp = layer.mlp
        if not type(mlp).__name__.endswith("MLP"):  # an MoE block routes tokens: not one MLP over the row
            raise UnsupportedModel(f"model.tiled_mlp_tokens: layer {i}'s MLP is a {type(mlp).__name__}, not a dense "
                                   "MLP; tiling is implemented for dense MLPs only")
        mlp.forward = types.MethodType(tiled_forward(mlp.forward, count), mlp)
