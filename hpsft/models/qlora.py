"""QLoRA's base: the frozen base weight of every adapted layer stored quantised, dequantised for
the product (forward and input gradient; no weight gradient).

After the adapters are injected, each PEFT LoRA layer's `base_layer` (an `nn.Linear`) is replaced
by a layer holding the same weight quantised, and the bias as it was (`model.lora.quantize_base`):
- nf4, `model.lora.double_quant=true` (the default): torchao's NF4Tensor, torchtune's QLoRA
  (`NF4Linear`): blocks of NF4_BLOCK weights as 4-bit NormalFloat codes, one absmax scaler each,
  the scalers themselves quantised to 8 bits in blocks of `scaler_block_size` (QLoRA's double
  quantisation, which torchao's `to_nf4` always does); its forward is torchao's `linear_nf4`.
- nf4, `model.lora.double_quant=false`: the same codes with the scalers kept in fp32
  (`NF4SingleLinear`, hpsft's own few lines: torchao cannot switch the double quantisation off).
- int8: one int8 per weight and one fp32 absmax scale per output row (`Int8Linear`; the weight
  quantisation of bitsandbytes' LLM.int8 and torchao's int8 weight-only: q = round(w * 127 /
  absmax(row)), w ~ q * absmax(row) / 127).
The adapters stay in the model's dtype and PEFT adds their output to the base layer's, as for LoRA.

Only the adapted layers' base weights are quantised: the LM head (read as a tensor by the
fused loss), the embeddings and the norms stay in the model's dtype.
"""

import torch
from torch import nn
from torch.nn import functional as F

from hpsft.utils.errors import UserInputError

NF4_BLOCK = 64  # weights per 4-bit block (QLoRA's and torchtune's block size)
NF4_SCALER_BLOCKS = (256, 128, 64, 32)  # scalers per 8-bit block: the largest that divides the layer's scalers
# The 16 NormalFloat levels as torchao's NF4Tensor holds them (QLoRA's, to 4 digits): the single-quantised
# layer shares its codes and levels, so the two settings differ in the scalers only.
NF4_LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
              0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
INT8_MAX = 127  # symmetric int8: codes in [-127, 127], as LLM.int8's


def import_nf4():
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, linear_nf4, to_nf4
    except ImportError:
        raise UserInputError("model.lora.quantize_base=nf4 needs torchao, which is not installed: "
                             "pip install hpsft[lora]") from None
    return NF4Tensor, linear_nf4, to_nf4


def nf4_blocks(name: str, weight: torch.Tensor) -> int:
    """The number of NF4 blocks of `weight`; a weight not made of whole blocks is refused by name."""
    if weight.numel() % NF4_BLOCK:
        raise UserInputError(
            f"model.lora.quantize_base=nf4: {name}'s weight {tuple(weight.shape)} ({weight.numel()} values) is not a "
            f"multiple of {NF4_BLOCK} (NF4 blocks of {NF4_BLOCK}); leave it out of model.lora.target_modules, or use "
            "model.lora.quantize_base=none")
    return weight.numel() // NF4_BLOCK


def scaler_block_size(name: str, weight: torch.Tensor) -> int:
    """The double quantisation's block: the largest of NF4_SCALER_BLOCKS dividing the number of
    scalers (one per NF4_BLOCK weights); a layer none divides is refused by name."""
    if weight.numel() % NF4_BLOCK == 0:
        scalers = weight.numel() // NF4_BLOCK
        for block in NF4_SCALER_BLOCKS:
            if scalers % block == 0:
                return block
    raise UserInputError(
        f"model.lora.quantize_base=nf4: {name}'s weight {tuple(weight.shape)} ({weight.numel()} values) is not a "
        f"multiple of {NF4_BLOCK} x {NF4_SCALER_BLOCKS[-1]} (NF4 blocks of {NF4_BLOCK}, their scalers in blocks "
        f"of {NF4_SCALER_BLOCKS[-1]} or more); leave it out of model.lora.target_modules, use "
        "model.lora.double_quant=false (no scaler blocks), or model.lora.quantize_base=none")


def quantized(name: str, weight: torch.Tensor):
    """`weight` as an NF4Tensor (in its own dtype: what dequantisation returns)."""
    _, _, to_nf4 = import_nf4()
    return to_nf4(weight.detach().contiguous(), NF4_BLOCK, scaler_block_size(name, weight))


class DequantizedMatmul(torch.autograd.Function):
    """x @ W.T with W dequantised from `layer` in the forward and again in the backward (no weight
    gradient): no dense copy of W outlives the product (as torchao's linear_nf4)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "QuantizedLinear") -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantized(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.layer.dequantized(grad.dtype), None


class QuantizedLinear(nn.Module):
    """A frozen linear layer whose weight is stored quantised in buffers (`weight` and its scales)
    and dequantised for each product."""

    # Left out of checkpoints (engine/deepspeed/checkpoint.frozen_names), as frozen parameters are:
    # a resume quantises model.path's weights again, bit for bit. The scales are non-persistent
    # buffers (in no state dict: neither checkpoint nor export names carry them).
    frozen_buffers = ("weight",)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype  # what dequantisation returns by default (the merge's W)
        self.bias = linear.bias

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = DequantizedMatmul.apply(x, self)
        return out if self.bias is None else out + self.bias


class Int8Linear(QuantizedLinear):
    """int8 weights, one fp32 absmax scale per output row (LLM.int8's weight quantisation)."""

    def __init__(self, name: str, linear: nn.Linear):
        super().__init__(linear)
        weight = linear.weight.detach().float()
        # A row of zeros gets scale 0 and codes 0 (its dequantisation is exact).
        scale = weight.abs().amax(dim=1) / INT8_MAX
        codes = torch.where(scale[:, None] > 0, weight / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None], 0.0)
        self.register_buffer("weight", codes.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8))
        self.register_buffer("scale", scale, persistent=False)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype or self.dtype)


class NF4SingleLinear(QuantizedLinear):
    """NF4 codes (two a byte) with one fp32 absmax scaler per NF4_BLOCK weights: QLoRA without the
    double quantisation (model.lora.double_quant=false). The codes are torchao's (the nearest level
    to each weight over its block's absmax), so only the scalers differ from NF4Linear's."""

    def __init__(self, name: str, linear: nn.Linear):
        super().__init__(linear)
        weight = linear.weight.detach().float()
        blocks = weight.reshape(nf4_blocks(name, weight), NF4_BLOCK)
        absmax = blocks.abs().amax(dim=1)
        levels = torch.tensor(NF4_LEVELS)
        # The nearest level: a value on a midpoint goes to the lower level, as torchao's argmin does.
        codes = torch.bucketize(blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None],
                                (levels[1:] + levels[:-1]) / 2).to(torch.uint8).flatten()
        self.register_buffer("weight", codes[::2] << 4 | codes[1::2])
        self.register_buffer("absmax", absmax, persistent=False)
        self.register_buffer("levels", levels, persistent=False)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        codes = torch.stack([self.weight >> 4, self.weight & 0b1111], dim=1).flatten().long()
        blocks = self.levels[codes].reshape(-1, NF4_BLOCK) * self.absmax[:, None]
        return blocks.reshape(self.out_features, self.in_features).to(dtype or self.dtype)


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is an NF4Tensor (torchtune's LoRALinear base path)."""

    # Left out of checkpoints (engine/deepspeed/checkpoint.frozen_names), as frozen parameters are:
    # a resume quantises model.path's weights again, bit for bit; and DeepSpeed's torch.load of an
    # NF4Tensor failed ("Callable map_location not supported with _rebuild_wrapper_subclass").
    frozen_buffers = ("weight",)

    def __init__(self, name: str, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A buffer, not a parameter: DeepSpeed broadcasts every parameter from rank 0 as bytes
        # (`p.data.view(torch.uint8)`, which NF4Tensor does not implement) and moves parameters by
        # swapping them (which failed for it, "Couldn't swap NF4Linear.weight"); each rank
        # quantises the same weights from the model folder, bit for bit.
        self.register_buffer("weight", quantized(name, linear.weight))
        self.bias = linear.bias

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        weight = self.weight.get_original_weight()
        return weight if dtype is None else weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, linear_nf4, _ = import_nf4()
        out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias


def quantized_layer_class(lora_config) -> type:
    """The base-layer class of `model.lora`'s quantize_base and double_quant."""
    if lora_config.quantize_base == "int8":
        return Int8Linear
    return NF4Linear if lora_config.double_quant else NF4SingleLinear


def quantized_linear(name: str, linear: nn.Linear, lora_config) -> nn.Module:
    return quantized_layer_class(lora_config)(name, linear)


def dequantized(name: str, weight: torch.Tensor, lora_config) -> torch.Tensor:
    """The weight a QLoRA layer computes with, from a dense base weight (the model folder's, read
    by `hpsft export`) quantised and dequantised as training did."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return quantized_linear(name, linear, lora_config).dequantized()


def stored_bytes(layer: nn.Module) -> int:
    """The bytes a quantised base layer's weight takes: its buffers (an NF4Tensor's inner tensors)."""
    total = 0
    for buffer in layer.buffers(recurse=False):
        if hasattr(buffer, "__tensor_flatten__"):
            names, _ = buffer.__tensor_flatten__()
            total += sum(getattr(buffer, n).numel() * getattr(buffer, n).element_size() for n in names)
        else:
            total += buffer.numel() * buffer.element_size()
    return total
