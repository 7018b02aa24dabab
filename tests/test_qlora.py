"""QLoRA (model.lora.quantize_base=nf4): the adapted layers' frozen base weights stored as
torchao's NF4Tensor. A 2-rank run (gloo, CPU) under ZeRO-2 and under ZeRO-3 is PEFT's LoRA on the
dequantised base in the first steps' loss and unclipped gradient norm, resumes in one process
exactly (in one process and at 2 ranks), its merged export is that base plus the adapters, its
streamed build equals the dense one bit for bit, and the settings it cannot run are refused by name."""

import json
from pathlib import Path

import pytest
import torch

from hpsft.models.lora import base_name
from tests.conftest import read_metrics, run_cli, write_parquet, write_tiny_llama
from tests.test_export import folder_weights
from tests.test_lora import (CHECK_SCRIPT, LOGIT_RTOL, RANK, ALPHA, SEED, assert_pefts_first_steps,
                             assert_resumes_exactly, assert_same_steps, lora_check, lora_overrides,
                             peft_reference_steps, quantize_base_layers, tiny_dora_model)
from tests.test_spmd_training import assert_ok


@pytest.mark.slow
@pytest.mark.parametrize("quantize_base, double_quant, stage", [
    ("nf4", True, 3), ("int8", True, 3), ("nf4", False, 2)],
    ids=["nf4-zero3", "int8-zero3", "nf4-single-quant-zero2"])
def test_qlora_at_two_ranks_is_pefts_lora_on_the_dequantised_base_resumes_and_exports_merged(
        tmp_path, tiny_chat_model, chat_rows, quantize_base, double_quant, stage):
    """Each quantisation mode (nf4, int8, nf4 single-quantised) and each ZeRO stage (2, 3) in some
    run, pairwise: nf4's NF4Tensor buffers and int8's plain ones under ZeRO-3 (the stage that
    partitions the model around them), the single-quantised NF4's plain buffers under ZeRO-2
    (nf4 at ZeRO-2 was a fourth run, dropped for time: its buffers stay whole there as any
    buffer does). tiny_chat_model, packed rows, the fused loss, 2 ranks under ZeRO-2 (DeepSpeed broadcasts
    no buffer and partitions only the adapters' optimizer state: the NF4 weights, buffers, stay
    whole on each rank) and under ZeRO-3 (the model built whole, quantised, then partitioned by
    deepspeed.initialize: every parameter, adapters included, partitioned; the 14 NF4 buffers stay
    whole 4-bit on each rank). Steps 1-2 equal PEFT's LoRA model on the base whose decoder linear
    weights went through torchao's NF4 round trip (tests/nf4_reference.py), the same initial
    adapters, in one process: loss and unclipped gradient norm within 1e-5 (fp32 rounding;
    measured loss 3.0e-9 and 9.0e-8 at both stages, norm 1.2e-8 and 2.8e-7 (ZeRO-2), 8.4e-8 and
    2.5e-7 (ZeRO-3) apart). Resumed from step 2 in one process (the checkpoint holds the adapters
    and their moments, no NF4 weight: the resume quantises model.path again), steps 3-4 equal the
    straight run's (loss within 1e-6: measured equal at ZeRO-2, 2.2e-8 at ZeRO-3; norm within 1e-5:
    8.3e-8 at most). The dequantised base never changes; the merged hf/ folder computes PEFT's
    adapter on that base within 1e-5 (measured 3.0e-7; the engine's logits equal it exactly), and
    `hpsft export`'s merge (the folder's weights quantised and dequantised again) equals it bit for
    bit. Planted: the base quantised in blocks of 32 weights, not 64 (qlora.NF4_BLOCK): the 14 NF4
    base weights differ from torchao's 64-block round trip (base_changed), and the engine's logits
    are 9.1e-2 off PEFT's. Planted: the adapters' Adam moments dropped on resume (zeros in
    universal.load_universal_without_zero), ZeRO-2: step 4's loss 10.79539 against 10.79159 (3.5e-4
    relative). Planted: the resumed process quantising another base (the weights x1.01 before
    to_nf4 in one process), ZeRO-3: step 3's loss 3.4e-5 off, its norm 0.3634 against 0.3585.
    Resumed at 2 ranks too (nf4, ZeRO-2 and ZeRO-3: steps 3-4 equal bit for bit). Planted: the
    optimizer state not loaded in the same-layout load (checkpoint.load_native), ZeRO-2: the 1-process
    resume passed, the 2-rank one failed, step 4's loss 10.79104 against 10.79159 (5.0e-5).
    (The two ZeRO-2 plants were seen at nf4-zero2; re-planted on nf4-single-quant-zero2 once that run
    was dropped: the moments zeroed failed the one-process resume's steps 3-4, the native load
    without optimizer state the 2-rank resume's step 4, 10.79104 against 10.79159, 5.0e-5.)
    Before the fix (the NF4 buffers saved in the checkpoint) the resume failed in DeepSpeed's
    torch.load: "Callable map_location not supported with _rebuild_wrapper_subclass"."""
    train = write_parquet([{"messages": c} for c in chat_rows[:4]], tmp_path / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[16:20]], tmp_path / "val.parquet")
    out = tmp_path / "run"
    qlora = {"model.lora.quantize_base": quantize_base, "model.lora.double_quant": str(double_quant).lower(),
             "engine.zero_stage": stage}
    assert_ok(run_cli(None, lora_overrides(tiny_chat_model, train, val, out, **qlora), nproc=2, script=CHECK_SCRIPT))
    check = lora_check(out)
    assert check["trainable"] == check["adapters"] and len(check["adapters"]) == 2 * 7 * 2
    assert check["adapters_unchanged"] == []
    # The quantised weights among them, dequantised: bit for bit torchao's round trip of the folder's.
    assert check["base_compared"] >= 2 * 7 and check["base_changed"] == []
    # The 14 base weights are quantised on each rank, whole (the folder's shapes), under ZeRO-3 too,
    # where every parameter left (embedding, norms, adapters) is partitioned; their bytes counted.
    shapes = {name: list(tensor.shape) for name, tensor in folder_weights(Path(tiny_chat_model)).items()}
    quantized = check["quantized"]
    assert len(quantized) == 2 * 7
    for name, layer in quantized.items():
        rows, cols = shape = shapes[base_name(name)]
        values = rows * cols
        if quantize_base == "int8":  # one byte a weight, an fp32 scale per row
            assert layer["dtype"] == "torch.int8" and layer["shape"] == shape and layer["bytes"] == values + 4 * rows
        elif not double_quant:  # two codes a byte, an fp32 absmax per 64 weights, the 16 fp32 levels
            assert layer["dtype"] == "torch.uint8" and layer["bytes"] == values // 2 + 4 * values // 64 + 16 * 4
        else:  # the scalers 8-bit: one byte per 64 weights, and per scaler block an fp32 factor
            assert layer["class"] == "NF4Linear" and layer["shape"] == shape
            assert values // 2 + values // 64 < layer["bytes"] < values // 2 + 4 * values // 64
    assert len(check["nf4_buffers"]) == (2 * 7 if quantize_base == "nf4" and double_quant else 0)
    assert len(check["partitioned"]) == (len(check["adapters"]) + len(shapes) - 2 * 7 if stage == 3 else 0)
    assert check["merged_vs_adapter"] < LOGIT_RTOL and check["engine_vs_adapter"] < LOGIT_RTOL
    assert check["base_vs_adapter"] > 1e-3

    straight = assert_pefts_first_steps(out, tiny_chat_model, train, quantize_base=quantize_base,
                                        double_quant=double_quant)
    # Resumed from step 2 in one process (the NF4 buffers and the adapters' moments from the checkpoint).
    assert_resumes_exactly(tiny_chat_model, train, val, out, tmp_path / "resumed", straight, **qlora)
    # Resumed at 2 ranks, the layout it was saved in (ZeRO-3: each rank its own partition back).
    assert_resumes_exactly(tiny_chat_model, train, val, out, tmp_path / "resumed-2", straight, nproc=2, **qlora)

    config = json.loads((out / "checkpoints" / "global_step_4" / "run_fingerprint.json").read_text())
    assert config["model.lora"]["quantize_base"] == quantize_base
    assert config["model.lora"].get("double_quant", True) == double_quant
    assert_ok(run_cli("hpsft.cli", ["export", str(out), str(tmp_path / "merged")]))
    merged, final = folder_weights(tmp_path / "merged"), folder_weights(out / "hf")
    assert merged.keys() == final.keys() and all(torch.equal(merged[name], final[name]) for name in final)
    assert all(tensor.dtype == torch.float32 for tensor in final.values())  # the base folder's dtype


BF16_RTOL = 2**-8  # bf16's relative rounding (8 significant bits): one rounding of the weights and activations
QUANTIZED_SETTINGS = [("nf4", True), ("int8", True), ("nf4", False)]
QUANTIZED_IDS = ["nf4", "int8", "nf4-single-quant"]


@pytest.mark.slow
@pytest.mark.parametrize("quantize_base, double_quant", QUANTIZED_SETTINGS, ids=QUANTIZED_IDS)
def test_bf16_qlora_keeps_the_quantised_base_and_its_first_step_is_the_fp32_references(
        tmp_path, tiny_chat_model, chat_rows, quantize_base, double_quant):
    """engine.dtype=bfloat16, 2 ranks, ZeRO-1: DeepSpeed's bf16 cast of the module casts parameters
    only, so the quantised buffers stay as they are (NF4: linear_nf4 reads them, a cast one would
    fail; int8 codes and fp32 scales; the single-quantised NF4 codes and fp32 absmax) and the
    quantisation is the fp32 one. Step 1's loss and unclipped gradient norm equal PEFT's fp32 LoRA
    on the round-tripped base (peft_reference_steps) within bf16's 2^-8 relative (one rounding of
    the weights and activations; the loss, ln(49152) on this random model, is insensitive).
    nf4: measured loss 9.2e-8, norm 1.4e-4 apart. Planted (nf4): the base quantised in blocks of 32
    (qlora.NF4_BLOCK): the norm 0.35821 against 0.35496, 9.1e-3 relative, failed (the loss, 2.5e-4
    off, would have passed). int8: measured loss 2.6e-6, norm 7.4e-4; nf4-single-quant: 7.5e-6, 7.4e-4.
    Planted (int8): each row's scale taken from the next (torch.roll in Int8Linear): the norm 0.35037
    against 0.35847, 2.3e-2 relative, failed."""
    train = write_parquet([{"messages": c} for c in chat_rows[:4]], tmp_path / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[16:20]], tmp_path / "val.parquet")
    out = tmp_path / "run"
    assert_ok(run_cli("hpsft.train", lora_overrides(tiny_chat_model, train, val, out, **{
        "model.lora.quantize_base": quantize_base, "model.lora.double_quant": str(double_quant).lower(),
        "engine.zero_stage": 1, "engine.dtype": "bfloat16",
        "trainer.total_steps": 1, "trainer.save_every": 0, "trainer.export_hf": "false"}), nproc=2))
    ours = {m["step"]: m for m in read_metrics(out)}
    reference = {1: peft_reference_steps(tiny_chat_model, train, 1, quantize_base=quantize_base,
                                         double_quant=double_quant)[0]}
    print(f"\nstep 1, bf16 vs fp32 PEFT ({quantize_base}, double_quant={double_quant}): loss",
          ours[1]["train/loss"], reference[1]["train/loss"], "norm", ours[1]["train/grad_norm"],
          reference[1]["train/grad_norm"])
    assert_same_steps(ours, reference, (1,), loss_rtol=BF16_RTOL, grad_norm_rtol=BF16_RTOL)


def qlora_model(folder, trained: bool = True, quantize_base: str = "nf4", double_quant: bool = True):
    return tiny_dora_model(folder, use_dora=False, trained=trained, quantize_base=quantize_base,
                           double_quant=double_quant)


def qlora_merged(lm, quantize_base: str = "nf4", double_quant: bool = True):
    from hpsft.config.schema import LoraConfig
    from hpsft.models.hf_export import weight_names
    from hpsft.models.lora import merged_weights

    state = lm.state_dict()
    config = LoraConfig(rank=RANK, quantize_base=quantize_base, double_quant=double_quant)
    return dict(merged_weights(lm, ((n, state[n]) for n in weight_names(lm)), config))


@pytest.mark.parametrize("quantize_base, double_quant", QUANTIZED_SETTINGS, ids=QUANTIZED_IDS)
def test_qlora_merge_is_the_dequantised_base_plus_the_adapters_and_an_untrained_one_is_refused(
        tmp_path, quantize_base, double_quant):
    """In one process, write_tiny_llama's model: the QLoRA model's logits equal PEFT's LoRA on the
    round-tripped base (tests/nf4_reference.py: torchao's NF4 or int8) with the same adapters
    within 1e-5 (measured 0: the same products), and the base model loaded with merged_weights
    computes them within 1e-5 (measured 4.3e-7 nf4, 4.4e-7 int8, 4.4e-7 nf4 single-quantised),
    fp32 as the base; with B = 0 the merge equals the dequantised base and is refused. Planted
    (nf4): the dequantised scale off by 1.01: the merged model 1.4e-2 off PEFT's logits."""
    import peft
    from transformers import AutoModelForCausalLM

    from hpsft.utils.errors import UserInputError
    from tests.nf4_reference import dequantized_decoder

    folder = write_tiny_llama(tmp_path / "tiny-llama")
    lm = qlora_model(folder, quantize_base=quantize_base, double_quant=double_quant)
    ids = torch.randint(3, 512, (1, 48), generator=torch.Generator().manual_seed(2))
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = peft.get_peft_model(dequantized_decoder(base, quantize_base, double_quant),
                                    peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear")).eval()
    adapters = dict(lm.named_parameters())
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.requires_grad:
                param.copy_(adapters[name.removeprefix("base_model.model.")])
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    weights = qlora_merged(lm, quantize_base, double_quant)
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())
    missing, unexpected = merged.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        ours, theirs, from_merge = (model(input_ids=ids).logits for model in (lm, reference, merged))
    forward = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    merge = ((from_merge - theirs).abs().max() / theirs.abs().max()).item()
    print(f"\nQLoRA vs PEFT on the {quantize_base} base {forward:.1e}, merged vs PEFT {merge:.1e}")
    assert forward < LOGIT_RTOL and merge < LOGIT_RTOL
    with pytest.raises(UserInputError, match="the merged model equals the base model"):
        qlora_merged(qlora_model(folder, False, quantize_base, double_quant), quantize_base, double_quant)


@pytest.mark.parametrize("overrides, message", [
    (["model.lora.quantize_base=int8", "model.lora.double_quant=false"], "model.lora.double_quant=false with "
     "model.lora.quantize_base=int8: double quantisation is nf4's (its block scalers); remove model.lora.double_quant"),
    (["model.lora.double_quant=false"], "model.lora.double_quant=false with model.lora.quantize_base=none"),
    (["model.lora.quantize_base=fp4"], "model.lora.quantize_base='fp4' is not one of ['int8', 'nf4', 'none']"),
    (["model.lora.rank=0", "model.lora.quantize_base=nf4"], "model.lora.quantize_base=nf4 needs model.lora.rank > 0"),
    (["model.lora.use_dora=true", "model.lora.quantize_base=nf4"], "with model.lora.use_dora=true: DoRA on a "
     "quantised base is not supported; set model.lora.quantize_base=none"),
    (["model.lora.quantize_base=nf4", "engine.name=megatron"], "model.lora.rank=4, model.lora.quantize_base=nf4 "
     "with engine.name=megatron: not on the Megatron engine yet"),
    (["model.lora.use_dora=true", "model.lora.quantize_base=int8"], "model.lora.quantize_base=int8 with "
     "model.lora.use_dora=true: DoRA on a quantised base is not supported"),
    (["model.lora.quantize_base=int8", "engine.name=megatron"], "model.lora.rank=4, model.lora.quantize_base=int8 "
     "with engine.name=megatron: not on the Megatron engine yet"),
], ids=["int8-double-quant", "none-double-quant", "unknown", "no-rank", "dora", "megatron", "int8-dora",
        "int8-megatron"])
def test_quantize_base_settings_it_cannot_run_are_refused_by_name(overrides, message):
    """Planted: the double_quant check removed: int8 with double_quant=false was accepted (no error)."""
    from hpsft.config import load_config

    with pytest.raises(ValueError) as err:
        load_config(None, ["model.lora.rank=4", "engine.zero_stage=2", *overrides])
    assert message in str(err.value)


def test_a_layer_no_scaler_block_divides_is_refused_by_name():
    """A 64 x 3 weight: 192 values, 3 NF4 blocks, which no scaler block of 32 or more divides."""
    from hpsft.models.qlora import scaler_block_size
    from hpsft.utils.errors import UserInputError

    assert scaler_block_size("q", torch.empty(64, 64)) == 64 and scaler_block_size("k", torch.empty(32, 64)) == 32
    assert scaler_block_size("big", torch.empty(2048, 2048)) == 256
    with pytest.raises(UserInputError, match=r"model.lora.quantize_base=nf4: odd's weight \(64, 3\) .* leave it out "
                                             "of model.lora.target_modules"):
        scaler_block_size("odd", torch.empty(64, 3))


@pytest.mark.parametrize("quantize_base, double_quant", QUANTIZED_SETTINGS, ids=QUANTIZED_IDS)
def test_a_quantised_layer_computes_torchaos_round_trip_and_stores_the_bytes_it_should(quantize_base, double_quant):
    """Each quantised base layer (qlora.quantized_linear) on weights of three shapes, one with a row
    of zeros: its dequantised weight equals torchao's own round trip (tests/nf4_reference.py: int8
    by torchao's affine primitives, single-quantised NF4 by its codes and exact block absmax) bit
    for bit, forward and input gradient equal F.linear on that weight (within 1e-6; measured 0),
    the weight gets no gradient, and the buffers hold the bytes the format says: int8 one byte a
    weight and an fp32 scale per row; NF4 half a byte a weight and per 64 an fp32 absmax (single)
    or an int8 scaler plus an fp32 factor per scaler block (double; between the two bounds).
    The two NF4 settings share their codes and differ in the scalers only (the dequantised weights
    not equal, and apart by at most one 8-bit step of the scalers: measured 4.9e-3 against 1.0e-2). Planted (int8): the scale of each row taken from the
    next (torch.roll by one row in Int8Linear): the round trip 1.6 off, failed; the codes floored,
    not rounded: failed (max difference 0.0045 of weights about 0.5)."""
    from torch.nn import functional as F

    from hpsft.config.schema import LoraConfig
    from hpsft.models.qlora import quantized_linear, stored_bytes
    from tests.nf4_reference import round_trip

    config = LoraConfig(rank=4, quantize_base=quantize_base, double_quant=double_quant)
    generator = torch.Generator().manual_seed(0)
    for rows, cols in ((64, 128), (96, 64), (32, 256)):
        linear = torch.nn.Linear(cols, rows)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(rows, cols, generator=generator) * 0.5)
            linear.weight[3] = 0.0
        layer = quantized_linear("layer", linear, config)
        reference = round_trip(linear.weight, quantize_base, double_quant)
        dense = layer.dequantized()
        assert dense.dtype == torch.float32 and torch.equal(dense, reference), (dense - reference).abs().max()
        assert torch.equal(dense[3], torch.zeros(cols))
        x = torch.randn(5, cols, generator=generator, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, expected = layer(x), F.linear(x_ref, reference, linear.bias)
        out.square().sum().backward()
        expected.square().sum().backward()
        for ours, theirs in ((out, expected), (x.grad, x_ref.grad)):
            assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-6
        assert all(not b.requires_grad for b in layer.buffers()) and linear.bias.grad is not None
        values = rows * cols
        if quantize_base == "int8":
            assert layer.weight.dtype == torch.int8 and stored_bytes(layer) == values + 4 * rows
        elif not double_quant:
            assert layer.weight.dtype == torch.uint8 and stored_bytes(layer) == values // 2 + 4 * values // 64 + 16 * 4
        else:
            assert values // 2 + values // 64 < stored_bytes(layer) < values // 2 + 4 * values // 64
        if quantize_base == "nf4":
            other = quantized_linear("layer", linear, LoraConfig(rank=4, quantize_base="nf4",
                                                                 double_quant=not double_quant)).dequantized()
            # The codes' levels are at most 1 in size, so the weights differ by the scalers' 8-bit
            # rounding at most: one step, 2 * max|s - mean(s)| / 256 over the block absmaxes s (half a
            # step, but the largest is clamped to 127 of 128).
            scalers = linear.weight.detach().reshape(-1, 64).abs().amax(dim=1)
            bound = 2 * (scalers - scalers.mean()).abs().max() / 256
            print(f"{rows}x{cols}: nf4 double vs single quantised {(dense - other).abs().max():.2e}, bound {bound:.2e}")
            assert not torch.equal(dense, other) and (dense - other).abs().max() <= bound * (1 + 1e-5)


def write_tiny_qwen2(folder: Path) -> Path:
    """A 2-layer Qwen2 (biases on q, k and v; tied embeddings) stored in bf16, seed 0."""
    import transformers

    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )).to(torch.bfloat16).save_pretrained(folder)
    return folder


def every_tensor(lm) -> dict:
    """Name -> tensor of every parameter and buffer of `lm` (persistent or not), tied ones under
    each name, an NF4Tensor as its inner tensors."""
    tensors = {}
    for name, tensor in [*lm.named_parameters(remove_duplicate=False), *lm.named_buffers(remove_duplicate=False)]:
        if hasattr(tensor, "__tensor_flatten__"):
            inner, _ = tensor.__tensor_flatten__()
            tensors |= {f"{name}:{part}": getattr(tensor, part) for part in inner}
        else:
            tensors[name] = tensor
    return tensors


@pytest.mark.parametrize("model", ["llama-fp32", "qwen2-bf16-tied-bias"])
@pytest.mark.parametrize("quantize_base, double_quant", QUANTIZED_SETTINGS, ids=QUANTIZED_IDS)
def test_the_streamed_qlora_build_is_the_dense_build_bit_for_bit(tmp_path, model, quantize_base, double_quant):
    """load_qlora_causal_lm (the model built without its parameters, each adapted weight quantised
    as it is read from the folder) against the dense build (the fp32 model loaded whole, add_lora,
    quantize_base_layers): the same names, and every parameter and buffer, the quantised codes and
    scales (an NF4Tensor's inner tensors) and the adapters included, equal in dtype and bit for
    bit; tied embeddings stay tied and requires_grad is the adapters'. On write_tiny_llama's fp32
    model and on a Qwen2 stored in bf16 (cast to fp32 before the quantisation, as from_pretrained's
    dtype=float32) with biases on adapted layers. Planted: the adapted layer's bias not carried into
    its quantised layer (linear.bias = None): failed on the Qwen2 (6 names missing, the q, k, v
    biases of both layers), passed on the Llama (no bias)."""
    from hpsft.config.schema import LoraConfig
    from hpsft.models.loading import load_causal_lm, load_qlora_causal_lm
    from hpsft.models.lora import add_lora

    folder = (write_tiny_llama if model == "llama-fp32" else write_tiny_qwen2)(tmp_path / model)
    config = LoraConfig(rank=RANK, alpha=ALPHA, quantize_base=quantize_base, double_quant=double_quant)
    dense = add_lora(load_causal_lm(str(folder)), config, SEED)
    assert quantize_base_layers(dense, config) == 2 * 7
    streamed = load_qlora_causal_lm(str(folder), config, SEED)
    ours, theirs = every_tensor(streamed), every_tensor(dense)
    assert ours.keys() == theirs.keys(), ours.keys() ^ theirs.keys()
    differ = [name for name in theirs if ours[name].dtype != theirs[name].dtype
              or ours[name].shape != theirs[name].shape or not torch.equal(ours[name], theirs[name])]
    assert differ == [], differ[:5]
    assert ({n for n, p in streamed.named_parameters() if p.requires_grad}
            == {n for n, p in dense.named_parameters() if p.requires_grad})
    tied = dense.lm_head.weight is dense.model.embed_tokens.weight
    assert (streamed.lm_head.weight is streamed.model.embed_tokens.weight) == tied == (model != "llama-fp32")
    assert streamed.config.use_cache is False
