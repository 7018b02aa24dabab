"""The weights a quantised (QLoRA) base computes with, from torchao directly (not hpsft's qlora
module): each linear layer of the decoder quantised and dequantised.
- nf4: blocks of 64 weights; double-quantised, torchao's NF4Tensor with the scalers in blocks of
  the largest of 256, 128, 64, 32 that divides their number; single-quantised, the same codes
  (torchao's convert_to_norm_float_weight) times each block's exact absmax (get_block_absmax).
- int8: torchao's affine primitives, symmetric, per output row, codes in [-127, 127]."""

import torch
from torch import nn

WEIGHT_BLOCK = 64


def nf4_round_trip(weight: torch.Tensor, double_quant: bool = True) -> torch.Tensor:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, get_block_absmax, to_nf4

    scalers = weight.numel() // WEIGHT_BLOCK
    scaler_block = next((block for block in (256, 128, 64, 32) if scalers % block == 0), scalers)
    nf4 = to_nf4(weight.detach().contiguous(), WEIGHT_BLOCK, scaler_block)
    if double_quant:
        return nf4.get_original_weight()
    packed = NF4Tensor.convert_to_norm_float_weight(weight.detach(), scalers, WEIGHT_BLOCK, nf4.nf4)
    codes = torch.stack([packed >> 4, packed & 0b1111], dim=1).flatten().long()
    absmax = get_block_absmax(weight.detach().flatten(), WEIGHT_BLOCK)
    return (NF4Tensor.dequantize(codes, nf4.nf4).view(scalers, WEIGHT_BLOCK) * absmax[:, None]).view(weight.shape)


def int8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    from torchao.quantization.quant_primitives import (MappingType, choose_qparams_affine, dequantize_affine,
                                                       quantize_affine)

    block = (1, weight.shape[1])  # one scale per output row
    scale, zero = choose_qparams_affine(weight.detach(), MappingType.SYMMETRIC, block, torch.int8, -127, 127)
    codes = quantize_affine(weight.detach(), block, scale, zero, torch.int8, -127, 127)
    return dequantize_affine(codes, block, scale, zero, torch.int8, -127, 127, output_dtype=weight.dtype)


def round_trip(weight: torch.Tensor, quantize_base: str = "nf4", double_quant: bool = True) -> torch.Tensor:
    return int8_round_trip(weight) if quantize_base == "int8" else nf4_round_trip(weight, double_quant)


def dequantized_decoder(lm: nn.Module, quantize_base: str = "nf4", double_quant: bool = True) -> nn.Module:
    """`lm` (a Hugging Face causal LM) with every nn.Linear of its decoder (the LM head left out,
    as PEFT's all-linear does) replaced in place by its round trip."""
    with torch.no_grad():
        for module in lm.get_decoder().modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(round_trip(module.weight, quantize_base, double_quant))
    return lm
