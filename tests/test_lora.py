"""LoRA (PEFT) runs: only the adapters train and are checkpointed, their gradients are PEFT's
on the model's own loss, a resume with another rank count continues the run exactly, and both
exports (merged model, adapter alone) compute the trained model; under ZeRO-3 with 2 ranks
(gloo, CPU), where the base model is built partitioned. DoRA (model.lora.use_dora) the same
under ZeRO-2, with its magnitudes in the merge, and PEFT's DoRA layer against the paper's formula."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (REPO, base_overrides, read_metrics, run_cli, write_parquet, write_tiny_chat_model,
                            write_tiny_llama)
from tests.test_export import folder_weights
from tests.test_spmd_training import assert_ok, rel_diff

CHECK_SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_lora_and_check.py")
LOGIT_RTOL = 1e-5  # fp32: merged W + s*B@A vs the adapter's separate path; measured ~6e-7
RANK, ALPHA, LR, SEED = 4, 8, 1e-3, 0


def lora_overrides(model_path, train, val, out_dir, **extra) -> list[str]:
    # Every step trains on all 4 conversations of `train` (2 per rank): the reference below
    # knows each step's batch. A constant LR; peak FLOPs given: no start-up GEMM measurement.
    return base_overrides(model_path, train, val, out_dir, **{
        "model.lora.rank": RANK, "model.lora.alpha": ALPHA, "engine.zero_stage": 3, "data.train_batch_size": 4,
        "data.micro_batch_size_per_gpu": 2, "trainer.total_steps": 4, "trainer.save_every": 2,
        "optim.lr": LR, "optim.lr_scheduler": "constant", "trainer.seed": SEED,
        "trainer.peak_flops_per_device": 1e12, **extra})


def peft_reference_steps(model_path: str, train: str, steps: int, use_dora: bool = False,
                         quantize_base: str = "none", double_quant: bool = True) -> list[dict]:
    """Loss and unclipped adapter-gradient norm of the first `steps` steps of lora_overrides'
    run, each step on every conversation of `train`: PEFT's get_peft_model on the model's own
    eager forward and masked-label loss (each conversation alone, weighted by its loss tokens
    over the step's), the norm in fp64, clipped as DeepSpeed clips, torch's AdamW (1-D
    parameters, DoRA's magnitudes, not decayed, as hpsft's param_groups). Only the initial A
    and B come from hpsft (add_lora's seeded A, B = 0), copied in by name; DoRA's magnitudes
    are PEFT's own (the base rows' norms). `quantize_base` nf4 or int8: QLoRA's reference, PEFT's
    LoRA on the base whose decoder linear weights went through torchao's round trip
    (tests/nf4_reference.py, with `double_quant` for nf4)."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpsft.config.schema import LoraConfig, OptimConfig
    from hpsft.data.chat_tokenize import tokenize_conversation
    from hpsft.models.lora import add_lora

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples = []
    for row in pq.read_table(train).to_pylist():
        ids, mask = (torch.tensor(x) for x in tokenize_conversation(tokenizer, row["messages"]))
        examples.append((ids[None], torch.where(mask.bool(), ids, -100)[None], int(mask[1:].sum())))
    step_tokens = sum(n for _, _, n in examples)
    initial = dict(add_lora(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                            LoraConfig(rank=RANK, alpha=ALPHA, use_dora=use_dora), SEED).named_parameters())
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager")
    if quantize_base != "none":
        from tests.nf4_reference import dequantized_decoder

        dequantized_decoder(base, quantize_base, double_quant)
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear",
                                                      use_dora=use_dora))
    adapters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for name, p in adapters:
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(initial[name.removeprefix("base_model.model.")])
    optim = OptimConfig(lr=LR)
    groups = [{"params": [p for _, p in adapters if p.ndim == 2], "weight_decay": optim.weight_decay},
              {"params": [p for _, p in adapters if p.ndim == 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=tuple(optim.betas), eps=optim.eps)
    results = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for ids, labels, n in examples:
            term = model(input_ids=ids, labels=labels, use_cache=False).loss * n / step_tokens
            term.backward()
            loss += float(term.detach())
        norm = float(torch.sqrt(sum(p.grad.double().square().sum() for _, p in adapters)))
        if norm + 1e-6 > optim.grad_clip:
            for _, p in adapters:
                p.grad.mul_(optim.grad_clip / (norm + 1e-6))
        optimizer.step()
        results.append({"train/loss": loss, "train/grad_norm": norm})
    return results


def assert_same_steps(ours: dict, reference: dict, steps, loss_rtol: float, grad_norm_rtol: float) -> None:
    """Loss and unclipped gradient norm of each step: clipping binds and Adam is nearly
    scale-invariant, so a wrong gradient scale shows in the norm only."""
    for step in steps:
        for metric, rtol in (("train/loss", loss_rtol), ("train/grad_norm", grad_norm_rtol)):
            assert rel_diff(ours[step][metric], reference[step][metric]) <= rtol, (step, metric, ours[step], reference[step])


def lora_check(out: Path) -> dict:
    """CHECK_SCRIPT's record of the run in `out`, its logit differences printed."""
    check = json.loads((out / "lora_check.json").read_text())
    print(f"\nlogits: merged vs adapter {check['merged_vs_adapter']:.1e}, engine vs adapter "
          f"{check['engine_vs_adapter']:.1e}, base vs adapter {check['base_vs_adapter']:.1e}")
    return check


def assert_pefts_first_steps(out: Path, model_path: str, train: str, **reference) -> dict:
    """Steps 1-2 of the run in `out` are peft_reference_steps(**reference)'s in loss and
    unclipped gradient norm within 1e-5 (fp32 rounding); the run's step -> metrics."""
    straight = {m["step"]: m for m in read_metrics(out)}
    expected = dict(enumerate(peft_reference_steps(model_path, train, 2, **reference), start=1))
    print("steps 1-2, ours vs PEFT:", [(straight[s]["train/loss"], expected[s]["train/loss"],
                                         straight[s]["train/grad_norm"], expected[s]["train/grad_norm"]) for s in (1, 2)])
    assert_same_steps(straight, expected, (1, 2), loss_rtol=1e-5, grad_norm_rtol=1e-5)
    return straight


def assert_resumes_exactly(model_path: str, train: str, val: str, out: Path, resumed: Path, straight: dict,
                           nproc: int = 1, **overrides) -> None:
    """The run in `out` (lora_overrides with `overrides`), resumed from its step-2 checkpoint in
    `nproc` processes into `resumed`, gives the straight run's steps 3-4 on the same tokens: loss
    within 1e-6, unclipped gradient norm within 1e-5 (fp32 rounding of a different reduction order)."""
    checkpoint = out / "checkpoints" / "global_step_2"
    proc = run_cli("hpsft.train", lora_overrides(model_path, train, val, resumed, **overrides, **{
        "trainer.resume": checkpoint, "trainer.export_hf": "false"}), nproc=nproc)
    assert_ok(proc)
    assert f"resumed from {checkpoint} at step 2" in proc.stdout
    again = {m["step"]: m for m in read_metrics(resumed)}
    assert sorted(again) == [3, 4] and all(again[s]["train/tokens"] == straight[s]["train/tokens"] for s in again)
    print("steps 3-4, resumed vs straight:", [(again[s][metric], straight[s][metric]) for s in (3, 4)
                                               for metric in ("train/loss", "train/grad_norm")])
    assert_same_steps(again, straight, (3, 4), loss_rtol=1e-6, grad_norm_rtol=1e-5)


@pytest.mark.slow
def test_lora_under_zero3_trains_only_adapters_resumes_exactly_and_exports(tmp_path, tiny_chat_model, chat_rows):
    """On tiny_chat_model (no pretrained weights needed: every value is compared with PEFT's,
    the straight run's or the model folder's). Planted: the engine's backward without its
    dp_size factor (2 ranks' adapter gradients halved): failed on step 1's gradient norm, 0.180
    against PEFT's 0.359 (on the 2-layer SmolLM2: 0.92 against 1.84)."""
    train = write_parquet([{"messages": c} for c in chat_rows[:4]], tmp_path / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[16:20]], tmp_path / "val.parquet")
    out = tmp_path / "run"
    assert_ok(run_cli(None, lora_overrides(tiny_chat_model, train, val, out), nproc=2, script=CHECK_SCRIPT))
    check = json.loads((out / "lora_check.json").read_text())
    print(f"\nlogits: merged vs adapter {check['merged_vs_adapter']:.1e}, engine vs adapter "
          f"{check['engine_vs_adapter']:.1e}, base vs adapter {check['base_vs_adapter']:.1e}")

    # Only the adapters (A and B of the 7 linear layers of each of the 2 layers) require
    # gradients; every one of them moved, and no base weight changed by a single bit.
    assert check["trainable"] == check["adapters"] and len(check["adapters"]) == 2 * 7 * 2
    assert all(".lora_A." in name or ".lora_B." in name for name in check["adapters"])
    assert check["adapters_unchanged"] == []
    assert check["base_compared"] > 0 and check["base_changed"] == []
    # The merged hf/ folder and the base model with hf/adapter loaded by PEFT compute the
    # trained engine's logits; training moved them away from the base model's.
    assert check["merged_vs_adapter"] < LOGIT_RTOL and check["engine_vs_adapter"] < LOGIT_RTOL
    assert check["base_vs_adapter"] > 1e-3

    # Steps 1-2 are PEFT's: step 1's gradient is B's alone (B = 0 zeroes A's), step 2's both.
    straight = {m["step"]: m for m in read_metrics(out)}
    reference = dict(enumerate(peft_reference_steps(tiny_chat_model, train, 2), start=1))
    print("steps 1-2, ours vs PEFT:", [(straight[s]["train/grad_norm"], reference[s]["train/grad_norm"]) for s in (1, 2)])
    assert_same_steps(straight, reference, (1, 2), loss_rtol=1e-5, grad_norm_rtol=1e-5)  # measured 1.3e-6

    # A checkpoint holds the adapters and their optimizer state, not the base model.
    checkpoint = out / "checkpoints" / "global_step_2"
    checkpoint_bytes = sum(p.stat().st_size for p in checkpoint.iterdir())
    model_bytes = (Path(tiny_chat_model) / "model.safetensors").stat().st_size
    print(f"checkpoint {checkpoint_bytes / 2**20:.2f} MiB, model {model_bytes / 2**20:.1f} MiB")
    assert checkpoint_bytes < model_bytes / 20

    # Resumed mid-way in one process, the run continues as the 2-rank one did.
    assert_resumes_exactly(tiny_chat_model, train, val, out, tmp_path / "resumed", straight)

    # Other LoRA settings make another run: its checkpoint is refused, naming them.
    proc = run_cli("hpsft.train", lora_overrides(tiny_chat_model, train, val, tmp_path / "other", **{
        "trainer.resume": checkpoint, "model.lora.rank": 8}))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "model.lora: {rank: 4, alpha: 8.0, dropout: 0.0, target_modules: [all-linear]} -> {rank: 8," in proc.stderr

    # `hpsft export` of the final checkpoint, in one process: merged, it is the end of run's
    # hf/ bit for bit (base weights read from the model folder); alone, the adapter is hf/adapter's.
    assert_ok(run_cli("hpsft.cli", ["export", str(out), str(tmp_path / "merged")]))
    assert_ok(run_cli("hpsft.cli", ["export", str(out), str(tmp_path / "adapter"), "--adapter-only"]))
    merged, final = folder_weights(tmp_path / "merged"), folder_weights(out / "hf")
    assert merged.keys() == final.keys() == load_file(Path(tiny_chat_model) / "model.safetensors").keys()
    assert all(torch.equal(merged[name], final[name]) for name in final)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    end_of_run = load_file(out / "hf" / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == end_of_run.keys() and len(adapter) == len(check["adapters"])
    assert all(torch.equal(adapter[name], end_of_run[name]) for name in adapter)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_dora_at_two_ranks_is_pefts_resumes_exactly_and_exports_the_magnitude(tmp_path, tiny_chat_model, model_path,
                                                                              chat_rows, stage):
    """model.lora.use_dora on tiny_chat_model, packed rows, 2 ranks under ZeRO-2 and ZeRO-3 (there
    on tiny_chat_model with a 2048-wide MLP, whose 6 MLP weights of 131,072 values ZeRO-3 shards:
    DeepSpeed keeps a parameter under 1e5 values whole on every rank): steps 1-2 equal PEFT's own
    DoRA model (peft_reference_steps, use_dora) in the loss and the unclipped gradient norm within
    1e-5 (fp32 rounding; measured loss 3.7e-8, norm 9.7e-8 apart at ZeRO-2, 1.0e-7 and 3.9e-7 at
    ZeRO-3); the magnitudes train
    and are checkpointed, a resume in one process continues the 2-rank run exactly, and the merged
    hf/ folder computes the adapter model's logits (measured 3.1e-7), as `hpsft export`'s does bit
    for bit. Planted: the magnitudes frozen in add_lora (requires_grad False after the injection):
    28 trainable tensors, not 42; with that assertion moved after the comparison, step 1's gradient
    norm 0.359 against PEFT's 0.388 (the magnitudes' share gone). Planted (ZeRO-3): DoRA built
    partitioned (the worker's model_init entered): the injection failed on rank 1, "The size of
    tensor a (0) must match the size of tensor b (64)". Not caught: gather_dora_base_weights left
    out (the test passed: DeepSpeed's default reuse distance keeps the base weight gathered from
    the base layer's forward to the DoRA layer's)."""
    train = write_parquet([{"messages": c} for c in chat_rows[:4]], tmp_path / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[16:20]], tmp_path / "val.parquet")
    if stage == 3:
        tiny_chat_model = write_tiny_chat_model(tmp_path / "wide_mlp_model", model_path, intermediate_size=2048)
    dora = {"model.lora.use_dora": "true", "engine.zero_stage": stage}
    out = tmp_path / "run"
    assert_ok(run_cli(None, lora_overrides(tiny_chat_model, train, val, out, **dora), nproc=2, script=CHECK_SCRIPT))
    check = lora_check(out)
    # A, B and the magnitude of each of the 7 linear layers of each of the 2 layers train; all moved.
    magnitudes = [name for name in check["adapters"] if ".lora_magnitude_vector." in name]
    assert check["trainable"] == check["adapters"] and len(check["adapters"]) == 2 * 7 * 3 and len(magnitudes) == 14
    assert check["adapters_unchanged"] == [] and check["base_compared"] > 0 and check["base_changed"] == []
    assert check["merged_vs_adapter"] < LOGIT_RTOL and check["engine_vs_adapter"] < LOGIT_RTOL
    assert check["base_vs_adapter"] > 1e-3
    if stage == 3:  # the DoRA layers' base weights ZeRO-3 shards: the 3 MLP ones of each layer
        assert [n for n in check["sharded"] if ".base_layer." in n] == sorted(
            f"model.layers.{i}.mlp.{p}_proj.base_layer.weight" for i in range(2) for p in ("down", "gate", "up"))

    straight = assert_pefts_first_steps(out, tiny_chat_model, train, use_dora=True)

    assert_resumes_exactly(tiny_chat_model, train, val, out, tmp_path / "resumed", straight, **dora)
    config = json.loads((out / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True
    # `hpsft export` in one process (the adapters' layers built on meta from the fingerprint's
    # model.lora, use_dora included) merges as the end of the run did, bit for bit.
    assert_ok(run_cli("hpsft.cli", ["export", str(out), str(tmp_path / "merged")]))
    merged, final = folder_weights(tmp_path / "merged"), folder_weights(out / "hf")
    assert merged.keys() == final.keys() and all(torch.equal(merged[name], final[name]) for name in final)


def quantize_base_layers(lm, lora_config) -> int:
    """The dense QLoRA build's last step (the reference the streamed build, hpsft.models.qlora_build,
    is checked against): the base layer of every PEFT LoRA layer of the whole fp32 `lm` replaced
    by its quantised layer, in place; the number replaced."""
    from hpsft.models.lora import lora_layers
    from hpsft.models.qlora import quantized_linear

    layers = lora_layers(lm)
    for name, layer in layers.items():
        layer.base_layer = quantized_linear(name, layer.base_layer, lora_config)
    return len(layers)


def tiny_dora_model(folder: Path, use_dora: bool = True, trained: bool = True, quantize_base: str = "none",
                    double_quant: bool = True):
    """write_tiny_llama's model (fp32) with adapters (rank 4) on every linear layer, as add_lora
    makes them (quantize_base nf4 or int8: over a quantised base, as the training worker builds it); `trained`:
    B and (DoRA) the magnitudes moved off their initial values (seed 1), enough for the merge to matter."""
    from transformers import AutoModelForCausalLM

    from hpsft.config.schema import LoraConfig
    from hpsft.models.lora import add_lora

    config = LoraConfig(rank=RANK, alpha=ALPHA, use_dora=use_dora, quantize_base=quantize_base,
                        double_quant=double_quant)
    lm = add_lora(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), config, SEED).eval()
    if quantize_base != "none":
        assert quantize_base_layers(lm, config) == 2 * 7
    if trained:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in lm.named_parameters():
                if ".lora_B." in name:
                    param.copy_(0.05 * torch.randn(param.shape, generator=generator))
                elif ".lora_magnitude_vector." in name:
                    param.mul_(1 + 0.2 * torch.randn(param.shape, generator=generator))
    return lm


def merged_model(folder: Path, lm):
    """The base model of `folder` with merged_weights(lm) loaded, every weight checked present."""
    from transformers import AutoModelForCausalLM

    from hpsft.models.hf_export import weight_names
    from hpsft.models.lora import merged_weights

    state = lm.state_dict()
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    missing, unexpected = merged.load_state_dict(dict(merged_weights(lm, ((n, state[n]) for n in weight_names(lm)))),
                                                 strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state), (missing, unexpected)
    return merged


def test_dora_merge_applies_the_magnitude_and_reproduces_the_adapter_models_logits(tmp_path):
    """merged_weights of a DoRA model (write_tiny_llama's, fp32, B and magnitudes moved off their
    initial values): the base model with the merged weights computes the adapter model's logits
    within 1e-5 relative (measured 3.2e-7; the base model's are 0.6 off). Planted: the merge
    without the magnitude factor (merged_weight's DoRA branch skipped): 3.9e-1 off the adapter
    model's logits."""
    from transformers import AutoModelForCausalLM

    folder = write_tiny_llama(tmp_path / "tiny-llama")
    lm = tiny_dora_model(folder)
    ids = torch.randint(3, 512, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        adapter = lm(input_ids=ids).logits
        merged = merged_model(folder, lm)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(input_ids=ids).logits
    error = ((merged - adapter).abs().max() / adapter.abs().max()).item()
    moved = ((base - adapter).abs().max() / adapter.abs().max()).item()
    print(f"\nmerged vs DoRA adapter model {error:.1e}, base vs adapter model {moved:.1e}")
    assert error < LOGIT_RTOL and moved > 1e-2


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_a_merge_equal_to_the_base_model_is_refused(tmp_path, use_dora):
    """Untrained adapters (B = 0; DoRA's magnitudes the base rows' norms) merge to the base
    model's weights bit for bit: refused rather than written as a fine-tune. Planted: the
    check removed: DID NOT RAISE (both)."""
    from hpsft.utils.errors import UserInputError

    folder = write_tiny_llama(tmp_path / "tiny-llama")
    with pytest.raises(UserInputError, match="the merged model equals the base model"):
        merged_model(folder, tiny_dora_model(folder, use_dora=use_dora, trained=False))


def test_peft_dora_layer_is_the_papers_formula_with_its_norm_detached():
    """PEFT's DoRA linear layer (what hpsft trains) against the DoRA paper's layer written out in
    fp64: y = x @ (m * V / ||V||)^T with V = W + s * B @ A and ||V|| (per output row) a constant
    in the backward (section 4.3). Output and the gradients of m, A and B within 1e-12.
    Planted (PEFT's DoraLinearLayer.forward patched in this process): both detaches of the norm
    removed (`lora_weight.detach()` and `weight_norm.detach()`: the norm differentiated into A
    and B): A's gradient 3.0e-1 relative off. The second alone removed changes nothing (passed):
    the norm's only inputs are then W, frozen, and the detached B @ A."""
    import peft

    torch.manual_seed(0)
    module = torch.nn.Sequential()
    module.add_module("proj", torch.nn.Linear(8, 6, bias=True, dtype=torch.float64))
    peft.inject_adapter_in_model(peft.LoraConfig(r=3, lora_alpha=6, target_modules=["proj"], use_dora=True), module)
    layer = module.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=0.3)
        layer.lora_magnitude_vector["default"].weight.mul_(1 + 0.2 * torch.randn(6, dtype=torch.float64))
    x, g = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    (module(x) * g).sum().backward()

    weight, bias = layer.base_layer.weight.detach(), layer.base_layer.bias.detach()
    a, b, m = (p.detach().clone().requires_grad_() for p in (
        layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.lora_magnitude_vector["default"].weight))
    direction = weight + layer.scaling["default"] * b @ a
    y = x @ (m[:, None] * direction / torch.linalg.norm(direction, dim=1, keepdim=True).detach()).T + bias
    (y * g).sum().backward()
    assert torch.allclose(module(x), y, rtol=1e-12, atol=0)
    for ours, theirs in ((m, layer.lora_magnitude_vector["default"].weight), (a, layer.lora_A["default"].weight),
                         (b, layer.lora_B["default"].weight)):
        error = ((theirs.grad - ours.grad).abs().max() / ours.grad.abs().max()).item()
        assert error < 1e-12, (theirs.shape, error)


def test_the_run_fingerprint_names_use_dora_only_when_set():
    """A LoRA run's fingerprint keeps the four keys it had before use_dora existed (its
    checkpoints still resume); a DoRA run's adds use_dora, so neither resumes the other.
    Planted: lora_fingerprint as dataclasses.asdict alone: the LoRA one gained use_dora: False."""
    from hpsft.config.schema import LoraConfig
    from hpsft.trainer.fingerprint import differences, lora_fingerprint

    lora = lora_fingerprint(LoraConfig(rank=4, alpha=8.0))
    assert lora == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"]}
    dora = lora_fingerprint(LoraConfig(rank=4, alpha=8.0, use_dora=True))
    assert dora == {**lora, "use_dora": True}
    assert differences({"model.lora": lora}, {"model.lora": dora}) == [
        "model.lora: {rank: 4, alpha: 8.0, dropout: 0.0, target_modules: [all-linear]} -> "
        "{rank: 4, alpha: 8.0, dropout: 0.0, target_modules: [all-linear], use_dora: True}"]
