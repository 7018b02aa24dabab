"""Build a QLoRA model (`model.lora.quantize_base`) without ever holding the whole fp32 model.

The model is constructed with its parameters on the meta device (buffers, e.g. the rotary
frequencies, built for real), each parameter then replaced by a one-value stand-in of its shape
and dtype on the CPU, so that PEFT injects real adapters (drawn from the seed as add_lora draws
them on a dense model; PEFT would move adapters onto a meta base layer's device). The folder's
safetensors are then read one tensor at a time: an adapted layer's weight becomes its quantised
base layer as it is read (its fp32 copy dropped at once), every other tensor fills its stand-in
in place (tied weights stay tied). The peak is the unquantised tensors, the quantised ones and
one fp32 weight, not the fp32 model (benchmarks/bench_qlora_build_memory.py). The result equals
the dense build (load_causal_lm, add_lora, every adapted layer's base quantised: tests/test_lora.py's
quantize_base_layers) bit for bit (tests/test_qlora.py). Under ZeRO-3 deepspeed.initialize then
partitions the unquantised parameters, as after the dense build.
"""

from pathlib import Path

import torch
from torch import nn

from hpsft.models.lora import add_lora, base_name, lora_layers
from hpsft.models.partitioned import (check_weights_match, empty_causal_lm, model_name_of, release_freed_memory,
                                     weight_files)
from hpsft.models.qlora import quantized_linear
from hpsft.utils.errors import UserInputError

READER = "model.lora.quantize_base"  # what reads the folder tensor by tensor, in the refusals' messages


def import_init_empty_weights():
    try:
        from accelerate import init_empty_weights
    except ImportError:
        raise UserInputError("model.lora.quantize_base needs accelerate (to build the model without its fp32 "
                             "weights), which is not installed: pip install hpsft[lora]") from None
    return init_empty_weights


def stand_in(param: nn.Parameter) -> nn.Parameter:
    """A CPU parameter of `param`'s shape, dtype and requires_grad holding one value (stride 0)."""
    return nn.Parameter(torch.zeros((), dtype=param.dtype).expand(param.shape), requires_grad=param.requires_grad)


def replace_with_stand_ins(lm: nn.Module) -> set[int]:
    """Every parameter of `lm` replaced by its stand-in, one per parameter (tied ones share it); their ids."""
    stand_ins: dict[int, nn.Parameter] = {}
    for module in lm.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = stand_ins.setdefault(id(param), stand_in(param))
    return {id(param) for param in stand_ins.values()}


@torch.no_grad()
def build_qlora_model(folder: Path, attn_implementation: str, trust_remote_code: bool, model_class,
                      lora_config, seed: int) -> nn.Module:
    """The model of `folder` in fp32 with `lora_config`'s adapters (add_lora, from `seed`) on a base
    whose adapted layers are quantised (qlora.quantized_linear) as their weights are read."""
    from safetensors import safe_open

    files = weight_files(folder, f"with {READER}")
    with import_init_empty_weights()(include_buffers=False):
        lm = empty_causal_lm(folder, attn_implementation, trust_remote_code, model_class)
    lm.tie_weights()  # as from_pretrained does: the file holds a tied weight once
    stand_ins = replace_with_stand_ins(lm)
    model_name = model_name_of(lm)  # before the adapters: the names the folder's are renamed to
    check_weights_match(lm, folder, files, model_name, READER, "save the model again with save_pretrained")
    add_lora(lm, lora_config, seed)
    adapted = {f"{prefix}.weight": (prefix, layer) for prefix, layer in lora_layers(lm).items()}
    # The folder's names: an adapted layer's bias is PEFT's `x.base_layer.bias`, the file's `x.bias`.
    tensors = {base_name(name): tensor for name, tensor in
               (dict(lm.named_parameters(remove_duplicate=False)) | dict(lm.named_buffers())).items()}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for saved in f.keys():
                name = model_name(saved)
                if name in adapted:
                    prefix, layer = adapted[name]
                    linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
                    # from_pretrained's fp32 cast, then the quantisation the dense build does
                    linear.weight = nn.Parameter(f.get_tensor(saved).to(torch.float32), requires_grad=False)
                    linear.bias = layer.base_layer.bias  # its stand-in, filled in place when read
                    stand_ins.discard(id(layer.base_layer.weight))
                    layer.base_layer = quantized_linear(prefix, linear, lora_config)
                    del linear
                    # glibc keeps the freed fp32 weight and the quantisation's temporaries in its heap
                    # (its mmap threshold rises past a weight's size once one is freed): resident memory
                    # grew by ~5 MiB a layer on the benchmark's model without this.
                    release_freed_memory()
                    continue
                target = tensors[name]
                value = f.get_tensor(saved).to(target.dtype)
                if id(target) in stand_ins:
                    target.data = value
                    stand_ins.discard(id(target))
                else:  # a persistent buffer
                    target.copy_(value)
    left = [name for name, param in lm.named_parameters() if id(param) in stand_ins]
    if left:  # check_weights_match found them all in the headers: a file read wrong
        raise RuntimeError(f"{folder}: no weights read for {left[:5]}")
    return lm
