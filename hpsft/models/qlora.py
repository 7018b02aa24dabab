"""QLoRA's base: the frozen base weight of every adapted layer stored as torchao's 4-bit NF4Tensor.

torchtune's QLoRA, written here for PEFT's layers: after the adapters are injected, each PEFT
LoRA layer's `base_layer` (an `nn.Linear`) is replaced by an `NF4Linear` holding the same weight
quantised to NF4 (blocks of NF4_BLOCK weights, one absmax scaler each; the scalers themselves
quantised to 8 bits in blocks of `scaler_block_size`, QLoRA's double quantisation) and the
bias as it was. Its forward is torchao's `linear_nf4`: the weight dequantised to the input's
dtype for the product, in the backward too (no weight gradient; the input gradient only). The
adapters stay in the model's dtype and PEFT adds their output to the base layer's, as for LoRA.

Only the adapted layers' base weights are quantised: the LM head (read as a tensor by the
fused loss), the embeddings and the norms stay in the model's dtype.
"""

import torch
from torch import nn

from hpsft.utils.errors import UserInputError

NF4_BLOCK = 64  # weights per 4-bit block (QLoRA's and torchtune's block size)
NF4_SCALER_BLOCKS = (256, 128, 64, 32)  # scalers per 8-bit block: the largest that divides the layer's scalers


def import_nf4():
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, linear_nf4, to_nf4
    except ImportError:
        raise UserInputError("model.lora.quantize_base=nf4 needs torchao, which is not installed: "
                             "pip install hpsft[lora]") from None
    return NF4Tensor, linear_nf4, to_nf4


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
        f"of {NF4_SCALER_BLOCKS[-1]} or more); leave it out of model.lora.target_modules, or use "
        "model.lora.quantize_base=none")


def quantized(name: str, weight: torch.Tensor):
    """`weight` as an NF4Tensor (in its own dtype: what dequantisation returns)."""
    _, _, to_nf4 = import_nf4()
    return to_nf4(weight.detach().contiguous(), NF4_BLOCK, scaler_block_size(name, weight))


def dequantized(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight a QLoRA layer computes with: an NF4Tensor's dequantisation, or a dense base
    weight (the model folder's, read by `hpsft export`) quantised and dequantised as training did."""
    NF4Tensor, _, _ = import_nf4()
    return (weight if isinstance(weight, NF4Tensor) else quantized(name, weight)).get_original_weight()


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, linear_nf4, _ = import_nf4()
        out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias


def quantize_base_layers(lm: nn.Module) -> int:
    """Replace the base layer of every PEFT LoRA layer of `lm` by its NF4Linear, in place; the
    number replaced."""
    from hpsft.models.lora import lora_layers

    layers = lora_layers(lm)
    for name, layer in layers.items():
        layer.base_layer = NF4Linear(name, layer.base_layer)
    return len(layers)
