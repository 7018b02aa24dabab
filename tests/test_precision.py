"""bf16 training (`engine.dtype=bfloat16`) with the real DeepSpeed engine (gloo, CPU) and
`tiny_chat_model` (SmolLM2's shape and vocabulary, 64 wide: bf16 matmuls are slow on this
CPU, and what is tested, fp32 accumulation and reduction of bf16 gradients, needs no
pretrained weights), against references computed here without DeepSpeed:

- fp32: Hugging Face's own eager forward, one sequence at a time, cross-entropy in fp64
  over the supervised targets: the loss and gradient bf16 training approximates;
- fp64 sum of bf16 rows: each micro-batch row's bf16 gradient computed alone in plain
  PyTorch, summed in fp64. DeepSpeed computes bit-identical bf16 gradients per row, so
  this isolates what DeepSpeed adds: accumulation over micro-batches and reduction over
  ranks. In fp32 they agree to ~5e-10; in bf16 they would not (figures below).
"""

import pytest
import torch

from tests.conftest import REPO, base_overrides, read_metrics, run_cli, write_parquet, write_tiny_llama
from tests.numerics import relative_error

SCRIPT = str(REPO / "tests" / "dist_scripts" / "capture_step_grads.py")
LENGTHS = [40, 25, 60, 33, 48, 20, 55, 30]


@pytest.fixture(scope="module")
def sequences() -> list[dict]:
    """8 sequences of random tokens, each supervised on its last two thirds."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        loss_mask = torch.zeros(n, dtype=torch.bool)
        loss_mask[n // 3:] = True
        out.append({"input_ids": torch.randint(0, 49152, (n,), generator=g), "loss_mask": loss_mask})
    return out


def global_loss_tokens(sequences) -> int:
    # A sequence's first token is never a target: nothing before it predicts it.
    return sum(int(s["loss_mask"][1:].sum()) for s in sequences)


@pytest.fixture(scope="module")
def fp32_reference(tiny_chat_model, sequences) -> tuple[float, dict]:
    """(loss, gradients) of one step in fp32 from the Hugging Face model itself."""
    from hpsft.models import load_causal_lm

    lm = load_causal_lm(tiny_chat_model, attn_implementation="eager")
    total = global_loss_tokens(sequences)
    loss = 0.0
    for s in sequences:
        logits = lm(input_ids=s["input_ids"][None], use_cache=False).logits[0, :-1].double()
        nll = torch.nn.functional.cross_entropy(logits, s["input_ids"][1:], reduction="none")
        seq_loss = (nll * s["loss_mask"][1:]).sum() / total
        seq_loss.backward()
        loss += float(seq_loss.detach())
    return loss, {k: p.grad.double() for k, p in lm.named_parameters()}


def bf16_rows_reference(model_path, rows, total: int) -> dict:
    """Each row's bf16 gradient alone (no DeepSpeed), summed over the rows in fp64."""
    from hpsft.models import PackedCausalLM, load_causal_lm

    model = PackedCausalLM(load_causal_lm(model_path))
    for p in model.parameters():  # bf16 weights; buffers (rotary frequencies) stay fp32, as DeepSpeed keeps them
        p.data = p.data.to(torch.bfloat16)
    grads = {k: torch.zeros(p.shape, dtype=torch.float64) for k, p in model.named_parameters()}
    for row in rows:
        model.zero_grad()
        (model(**row)["loss"] / total).backward()
        for k, p in model.named_parameters():
            grads[k] += p.grad.double()
    return grads


@pytest.fixture(scope="module")
def bf16_rows_references(tiny_chat_model, sequences):
    """bf16_rows_reference by micro-batch count, computed once for every engine: each splits
    the sequences into the same rows (checked)."""
    computed = {}  # micro-batches -> (rows, reference)

    def reference(micro_batches: int, rows: list[dict]) -> dict:
        if micro_batches not in computed:
            computed[micro_batches] = rows, bf16_rows_reference(tiny_chat_model, rows, global_loss_tokens(sequences))
        first_rows, grads = computed[micro_batches]
        assert len(rows) == len(first_rows) and all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
            for a, b in zip(rows, first_rows))
        return grads

    return reference


# Stage 1 runs DeepSpeed's BF16_Optimizer, stage 2 its ZeRO-1/2 optimizer, stage 3 its
# ZeRO-3 one (here with both offloads). Stage 1/2 with offload_optimizer and stage 3
# without offload gave the same figures when checked by hand (docs/precision.md).
ENGINES = {
    "zero1": "engine.zero_stage=1",
    "zero2": "engine.zero_stage=2",
    "zero3-offload": "engine.zero_stage=3 engine.offload_optimizer=true engine.offload_params=true",
}


@pytest.fixture(scope="module")
def bf16_steps(tmp_path_factory, tiny_chat_model, sequences) -> dict:
    """engine -> micro-batches -> the captured step: 2 ranks x 4 sequences, one step split
    into 1 and into 4 micro-batches per rank, every engine in one torchrun (one start-up)."""
    root = tmp_path_factory.mktemp("bf16")
    torch.save(sequences, root / "sequences.pt")
    proc = run_cli(None, [str(root / "sequences.pt"), str(root / "grads.pt"), "1,4", ";".join(ENGINES.values()),
                          f"model.path={tiny_chat_model}", "engine.dtype=bfloat16"], nproc=2, script=SCRIPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    steps = torch.load(root / "grads.pt")
    return {engine: steps[variant] for engine, variant in ENGINES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_bf16_step_accumulates_and_reduces_gradients_in_fp32(fp32_reference, bf16_steps, bf16_rows_references, engine):
    """The engine's step with 1 and with 4 micro-batches per rank (bf16_steps) against the
    fp32 and the fp64-sum-of-bf16-rows references."""
    steps = bf16_steps[engine]
    fp32_loss, fp32_grads = fp32_reference
    figures = {}  # all measured first: a failure shows every one
    for k, step in steps.items():
        figures[f"loss vs fp32, {k} mb"] = abs(step["loss"] - fp32_loss) / fp32_loss
        figures[f"grad vs fp32, {k} mb"] = relative_error(step["grads"], fp32_grads)
        figures[f"grad vs fp64 sum of bf16 rows, {k} mb"] = relative_error(step["grads"],
                                                                           bf16_rows_references(k, step["rows"]))
    figures["grad 1 vs 4 mb"] = relative_error(steps[4]["grads"], {k: g.double() for k, g in steps[1]["grads"].items()})
    shown = "; ".join(f"{name} {value:.2e}" for name, value in figures.items())
    print(f"\n{engine}: {shown}")
    for k, step in steps.items():
        # bf16 weights, fp32 master weights (measured on the 2-layer SmolLM2: 99.9% of them off
        # the bf16 grid after the step).
        assert step["weight_dtypes"] == ["torch.bfloat16"] and step["masters_beyond_bf16"] > 0.5
        # bf16 trains the same function: loss and gradient within bf16 rounding of the fp32
        # ones (measured on tiny_chat_model: loss 1.0e-5, gradient 5.8e-3 with 1 and with 4
        # micro-batches; on the 2-layer SmolLM2 6.7e-4 and 2.1e-3 to 2.3e-3).
        assert figures[f"loss vs fp32, {k} mb"] < 5e-3, shown
        assert figures[f"grad vs fp32, {k} mb"] < 1e-2, shown
        # Accumulation and reduction add fp32 rounding only. Measured on tiny_chat_model with
        # 4 micro-batches: 1.6e-8 (stage 1), 1.6e-8 (stages 2, 3). Planted: DeepSpeed's bf16
        # defaults (both settings dropped): 1.7e-3, 1.8e-3, 1.8e-3, failed; fp32 accumulation
        # but bf16 reduction: 1.0e-3 with 1 micro-batch at every stage, failed.
        assert figures[f"grad vs fp64 sum of bf16 rows, {k} mb"] < 1e-6, shown
    # The invariant, 1 vs 4 micro-batches: 1.4e-3 apart on tiny_chat_model (bf16
    # backward passes over differently packed rows round differently); with DeepSpeed's bf16
    # defaults 2.2e-3 (stage 1) and 2.4e-3 (stages 2, 3), failed (on the 2-layer SmolLM2:
    # 1.3e-3; 2.8e-3 and 4.1e-3).
    assert figures["grad 1 vs 4 mb"] < 2e-3, shown


@pytest.mark.slow
def test_bf16_trains_end_to_end_on_cpu_and_exports_its_fp32_masters(tmp_path, tiny_chat_model, chat_rows):
    """The real CLI in bf16 (ZeRO-1) on tiny_chat_model: training, validation and export run
    on CPU, and the loss falls on 8 conversations seen at every step (lr 1e-2: the random
    model's loss fell 0.34 in 4 steps at 1e-3). The exports against the last checkpoint's fp32
    master weights: the run's hf/ holds bf16 weights, each the master rounded once to bf16
    (what a bf16 user loads); `hpsft export` of the checkpoint writes the masters themselves,
    fp32 bit for bit. The masters must hold values bf16 cannot represent, or the comparison
    says nothing (measured: 3,207,423 of the 3,207,488). Found by this test: `hpsft export`
    refused every bf16 ZeRO-1 checkpoint (DeepSpeed's BF16_Optimizer files are "not a zero
    checkpoint" to zero_to_fp32; fixed in engine/deepspeed/weights.py). Planted: hf/ written in
    fp16 (`t.half()` on the gathered tensors in TrainingWorker.export_hf): the dtype check failed
    on model.embed_tokens.weight; `hpsft export` from bf16-rounded masters (`.bfloat16().float()`
    in checkpoint_weights): 0 of 3,207,488 master values unrepresentable in bf16."""
    train = write_parquet([{"messages": c} for c in chat_rows[:8]], tmp_path / "train.parquet")
    val = write_parquet([{"messages": c} for c in chat_rows[8:12]], tmp_path / "val.parquet")
    out = tmp_path / "run"
    proc = run_cli("hpsft.train", base_overrides(tiny_chat_model, train, val, out, **{
        "engine.dtype": "bfloat16", "engine.zero_stage": 1, "trainer.total_steps": 4, "optim.lr": 1e-2}))
    assert proc.returncode == 0, proc.stderr[-6000:]
    metrics = read_metrics(out)
    losses = [m["train/loss"] for m in metrics]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses
    assert 0 < metrics[-1]["val/loss"] < 100
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "hf").config.num_hidden_layers == 2
    from safetensors.torch import load_file

    from hpsft.trainer.export import export, find_checkpoint

    checkpoint = find_checkpoint(out)
    assert checkpoint.name == "global_step_4", checkpoint
    export(str(checkpoint), str(tmp_path / "masters"))
    masters = load_file(tmp_path / "masters" / "model.safetensors")
    in_run = load_file(out / "hf" / "model.safetensors")
    assert set(masters) == set(in_run) and masters, sorted(set(masters) ^ set(in_run))
    unrepresentable = 0
    for name, master in masters.items():
        assert master.dtype == torch.float32 and in_run[name].dtype == torch.bfloat16, (name, in_run[name].dtype)
        assert torch.equal(in_run[name], master.to(torch.bfloat16)), name
        unrepresentable += int((master.to(torch.bfloat16).float() != master).sum())
    assert unrepresentable > 0.9 * sum(m.numel() for m in masters.values()), unrepresentable


# One round-to-nearest in a dtype moves a value by at most its unit roundoff: 2^-8 of it in
# bf16 (7 stored mantissa bits), 2^-24 in fp32.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lora_merge_rounds_each_merged_weight_once_in_the_models_dtype(tmp_path, dtype):
    """The export's merge (merged_weights) of a model in `dtype` (a bf16 run hands it bf16 base
    weights and bf16 adapters) against W + scaling * B @ A in fp64 from the same tensors: each
    merged weight within one rounding to `dtype` of the exact value (plus fp32 rounding of the
    sum's terms), in `dtype`; every other tensor passed on unchanged. B is drawn (trained
    adapters are not 0) so that the update is as large as W and cancels it in places, where a
    merge rounded more than once is off by more than one rounding. Planted: the merge done in
    the weights' dtype (`B @ A` and the sum without `.float()`): bf16 failed, its worst weight
    221x its bound (fp32 passed, 0.13). Measured: the worst at 0.99 (bf16; one round-to-nearest
    reaches 2^-8 just above a power of 2) and 0.13 (fp32) of the bound."""
    from transformers import AutoModelForCausalLM

    from hpsft.config import LoraConfig
    from hpsft.models.hf_export import weight_names
    from hpsft.models.lora import add_lora, lora_layers, merged_weights

    lm = add_lora(AutoModelForCausalLM.from_pretrained(write_tiny_llama(tmp_path / "tiny"), dtype=dtype),
                  LoraConfig(rank=4, alpha=8), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    state = lm.state_dict()
    merged = dict(merged_weights(lm, ((name, state[name]) for name in weight_names(lm))))
    adapted = {f"{prefix}.weight": layer for prefix, layer in lora_layers(lm).items()}
    assert adapted and set(merged) == {n for n in state if ".lora_" not in n and ".base_layer." not in n} | set(
        adapted)
    worst = 0.0  # the largest error over its allowed bound
    for name, tensor in merged.items():
        assert tensor.dtype == dtype, name
        if name not in adapted:
            assert torch.equal(tensor, state[name]), name
            continue
        layer, prefix = adapted[name], name.removesuffix(".weight")
        w, a, b = (state[f"{prefix}.{part}.weight"].double() for part in ("base_layer", "lora_A.default",
                                                                             "lora_B.default"))
        scaling = layer.scaling["default"]
        exact = w + scaling * b @ a
        bound = UNIT_ROUNDOFF[dtype] * exact.abs() + 2.0**-20 * (w.abs() + scaling * b.abs() @ a.abs())
        worst = max(worst, float(((tensor.double() - exact).abs() / bound).max()))
    print(f"\n{dtype}: the worst merged weight at {worst:.3f} of its bound")
    assert worst <= 1.0, f"a merged weight {worst:.2f}x its bound of one rounding to {dtype}"
