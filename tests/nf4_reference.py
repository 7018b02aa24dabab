"""The weights a QLoRA base computes with, from torchao directly (not hpsft's qlora module): each
linear layer of the decoder quantised to NF4 in blocks of 64 weights, the scalers in blocks of
the largest of 256, 128, 64, 32 that divides their number, and dequantised."""

import torch
from torch import nn

WEIGHT_BLOCK = 64


def nf4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    scalers = weight.numel() // WEIGHT_BLOCK
    scaler_block = next(block for block in (256, 128, 64, 32) if scalers % block == 0)
    return to_nf4(weight.detach().contiguous(), WEIGHT_BLOCK, scaler_block).get_original_weight()


def dequantized_decoder(lm: nn.Module) -> nn.Module:
    """`lm` (a Hugging Face causal LM) with every nn.Linear of its decoder (the LM head left out,
    as PEFT's all-linear does) replaced in place by its NF4 round trip."""
    with torch.no_grad():
        for module in lm.get_decoder().modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(nf4_round_trip(module.weight))
    return lm
