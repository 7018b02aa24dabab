"""The Megatron engine (engine.name: megatron) under the same optimizer-step claims as every
ZeRO stage (tests/step_claims.py): the tiny Llama at DP=2, TP=2 and PP=2, the tiny Qwen3 (q/k
norm) at TP=2 and the tiny Mixtral (router loss on) at EP=2 x DP=2 (one 2-rank launch), and the
Llama at TP=2 x PP=2 and DP=2 x TP=2 (one 4-rank launch), each against the fp64 plain-torch reference: the unclipped gradient norms,
the clip, the non-finite step skipped without moving the schedule, warmup then cosine, AdamW
without decay on 1-D weights, the whole Hugging Face weights gathered after the steps, and the
per-rank checkpoint resuming into the same steps, at its own layout, (TP=2 x PP=2's) at TP=1
and DP=2 x TP=2, and (Mixtral EP=2's, fp32 and bf16) at EP=1; resharding's host memory; the CLI at
PP=2, TP=3 and EP=2 against DeepSpeed. And what the engine's config refuses."""

import json
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch

from hpsft.config import load_config
from hpsft.config.schema import EngineConfig
import torch

from tests.conftest import REPO, assert_ok, assert_same_steps, base_overrides, chat_parquet, cli_command, ray_env, \
    read_metrics, rel_diff, run_cli, train_steps, write_tiny_llama
from tests.dist_scripts.step_claims import SAVED_AFTER
from tests.megatron_models import write_hf_model
from tests.numerics import relative_error
from tests.step_claims import WEIGHT_RTOL, assert_norms, assert_steps_as_documented, run_layouts, run_models
from tests.test_precision import sequences  # noqa: F401 (the fixture: test_precision's 8 sequences)
from tests.test_ray import RAY_WORKERS, private_ray_tmpdir
from tests.test_spmd_training import max_rel_weight_diff, weights

pytest.importorskip("megatron.core")

# Mixtral's EP=2 x DP=2 checkpoint is resumed at EP=1 x DP=2 (each rank all 4 experts; TP > 1
# with MoE is refused: architecture.check_layout) in the same launch, in fp32 (mixtral_ep2) and in
# bf16 (MIXTRAL_BF16), checked by test_megatron_moe_checkpoint_resumes_at_other_layouts.
EP2, EP1 = "megatron:expert_parallel_size=2", "megatron:expert_parallel_size=1"
TP2 = "megatron:tensor_parallel_size=2"
MIXTRAL_BF16 = f"{EP2},dtype=bfloat16>{EP1},dtype=bfloat16"
# name: (model, layout, its data-parallel size); one 2-rank launch runs them all.
TWO_RANKS = {"dp2": ("llama", "megatron:tensor_parallel_size=1", 2),
             "tp2": ("llama", "megatron:tensor_parallel_size=2", 1),
             "pp2": ("llama", "megatron:pipeline_parallel_size=2", 1),
             "qwen3_tp2": ("qwen3", "megatron:tensor_parallel_size=2", 1),
             "mixtral_ep2": ("mixtral", f"{EP2}>{EP1}", 2)}
# The 2-layer tiny Llama of the ZeRO tests; the tiny Qwen3 (q/k norm) and Mixtral (4 experts,
# top 2, the router loss on at coefficient 0.1) of tests/megatron_models.py.
WRITERS = {"llama": write_tiny_llama, "qwen3": partial(write_hf_model, "qwen3"),
           "mixtral": partial(write_hf_model, "mixtral")}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    models = {model: (WRITERS[model], [layout for m, layout, _ in TWO_RANKS.values() if m == model])
              for model in WRITERS}
    models["mixtral"][1].append(MIXTRAL_BF16)
    return run_models(tmp_path_factory.mktemp("megatron_two_ranks"), models, nproc=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", TWO_RANKS)
def test_megatron_at_two_ranks_steps_as_documented_against_fp64_reference(two_rank_runs, name):
    """Planted, one at a time (docs/testing.md has the figures): the padding row's gradient
    from its lookups kept (model.keep_padding_row_still removed); the schedule moved by a
    skipped step (updates counted like taken); the router logits taken in row_terms instead of
    after every forward (run_schedule), so the start-up check's joined the first training
    row's router loss: mixtral_ep2 step 0 norm 1.45175 vs 1.45281 (7.3e-4), step 1 5.49923 vs
    5.39620. (Without the router loss, mixtral_without_router_loss, that bug did not show:
    the EP=2 norms were the reference's within 8.5e-7.) Each resumed engine validates the
    next step's rows before training them (step_claims.py, as trainer.val_before_train does);
    planted: validation's router logits not taken (infer_batch with router_logits unset):
    mixtral_ep2 resumed step 0 norm 0.357958 vs 0.358075."""
    model, layout, dp_size = TWO_RANKS[name]
    run = two_rank_runs[model][layout]
    assert run["dp_size"] == dp_size
    assert_steps_as_documented(run, two_rank_runs[model]["reference"], f"megatron {name}")


# name: (layout, its data-parallel size); one 4-rank launch runs both, and resumes TP=2 x PP=2's
# checkpoint at DP=2 x TP=2 too (test_megatron_checkpoint_resumes_at_other_layouts).
TP2_PP2, DP2_TP2 = "megatron:tensor_parallel_size=2,pipeline_parallel_size=2", "megatron:tensor_parallel_size=2"
FOUR_RANKS = {"tp2_pp2": (f"{TP2_PP2}>{DP2_TP2}", 1), "dp2_tp2": (DP2_TP2, 2)}


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("megatron_four_ranks"), [layout for layout, _ in FOUR_RANKS.values()],
                       nproc=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", FOUR_RANKS)
def test_megatron_at_four_ranks_steps_as_documented_against_fp64_reference(four_rank_runs, name):
    """The tiny Llama at TP=2 x PP=2 and at DP=2 x TP=2 (the replicas' gradients summed over DP
    on top of the TP shards). Planted: the DP reduction of the gradients dropped
    (summed_grads returning without finalize_model_grads): dp2_tp2 step 0 norm 0.97061 vs
    1.40108, failed; tp2_pp2 (DP=1) passed, as it should."""
    layout, dp_size = FOUR_RANKS[name]
    run = four_rank_runs[layout]
    assert run["dp_size"] == dp_size
    assert_steps_as_documented(run, four_rank_runs["reference"], f"megatron {name}")


# The resumed steps' losses against the straight run's: fp32 sums of the same tokens' NLL in
# another order and over other shards (TP=1 and DP=2 x TP=2 against TP=2 x PP=2): ~1e-7.
RESUMED_LOSS_RTOL = 1e-6


@pytest.mark.slow
def test_megatron_checkpoint_resumes_at_other_layouts(four_rank_runs, tmp_path):
    """TP=2 x PP=2's checkpoint after step 3 (4 ranks) resumed at TP=1 x PP=1 (1 rank, its own
    launch) and at DP=2 x TP=2 (in the 4-rank launch): steps 4-5 give the straight run's
    losses (within RESUMED_LOSS_RTOL) and the fp64 reference's unclipped grad norms (NORM_RTOL,
    1e-5), the schedule's rates, and the reference's weights after step 5 (WEIGHT_RTOL). Step
    4's norm depends on the weights alone; step 5's and the weights on Adam's moments and step
    count too. Planted, one at a time (docs/testing.md), each failing first at TP=1 on the
    (0-based) step-4 loss against the straight run's 6.261567: the moments zeroed on reshard
    6.264620 (4.9e-4); each writing TP rank's moments put at the other TP rank's place 6.264251
    (4.3e-4); Adam's step count reset to 0 6.268957 (1.2e-3)."""
    straight = four_rank_runs[FOUR_RANKS["tp2_pp2"][0]]
    resumed = {"tp1": resumed_in_one_process(straight, tmp_path), "dp2_tp2": straight["resumed_at"][DP2_TP2]}
    for name, run in resumed.items():
        assert_resumed_continues(run, straight, four_rank_runs["reference"], f"megatron tp2_pp2 resumed at {name}")


def resumed_in_one_process(straight: dict, tmp_path) -> dict:
    """The straight run's checkpoint resumed at TP=1 x PP=1 x EP=1 in a 1-rank launch of its own."""
    out = tmp_path / "tp1.pt"
    proc = run_cli(None, [str(out), straight["checkpoint"], "--resume", straight["model"],
                          "megatron:tensor_parallel_size=1"], nproc=1,
                   script=str(REPO / "tests" / "dist_scripts" / "step_claims.py"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def assert_resumed_continues(run: dict, straight: dict, reference: dict, what: str) -> None:
    """Steps 4-5 of a resumed run: the straight run's losses (RESUMED_LOSS_RTOL), the fp64
    reference's unclipped grad norms (NORM_RTOL) and weights after step 5 (WEIGHT_RTOL), the
    straight run's rates."""
    for step, (loss, expected) in enumerate(zip(run["losses"], straight["losses"][SAVED_AFTER:], strict=True)):
        assert rel_diff(loss, expected) <= RESUMED_LOSS_RTOL, \
            f"{what}: step {SAVED_AFTER + step} loss {loss} vs {expected}"
    assert_norms(run["grad_norms"], reference["grad_norms"][SAVED_AFTER:], what)
    assert run["lrs"] == straight["lrs"][SAVED_AFTER:] and run["global_steps"] == 5, what
    error = relative_error(run["weights"], reference["weights"])
    assert error < WEIGHT_RTOL, f"{what}: weights after step 5 {error:.2e} from the fp64 reference"


# bf16's relative rounding step (8 significant bits). Resumed at another layout, a master that
# fp32 rounding moves across a bf16 rounding boundary flips its bf16 weight by one step: the
# steps after the first resumed one, and the weights, differ from the straight run's by such
# flips (at most 2^-8 of the whole model if every element flipped).
BF16_STEP = 2.0**-8


@pytest.mark.slow
def test_megatron_moe_checkpoint_resumes_at_other_layouts(two_rank_runs, tmp_path):
    """The tiny Mixtral (4 experts, top 2, router loss 0.1) at EP=2 x DP=2 (experts 0-1 on rank
    0, 2-3 on rank 1), its checkpoint after step 3 resumed at EP=1 x DP=2 (each rank all four
    experts) in the same launch and at one process. fp32: as
    test_megatron_checkpoint_resumes_at_other_layouts, the straight run's losses and the fp64
    reference's unclipped grad norms and weights (measured: losses within 2.6e-8, norms 3.0e-6).
    bf16 (MIXTRAL_BF16, EP=2 x DP=2 resumed at EP=1 x DP=2) against the straight bf16 run: the
    first resumed step within fp32 rounding (RESUMED_LOSS_RTOL; its bf16 weights are the fp32
    masters rounded as the straight run's: measured loss equal, norm 6.6e-8), the next step's
    loss and norm and the weights after step 5 within BF16_STEP (measured 3.1e-6, 2.9e-4,
    5.6e-4). Planted: the resharding's Adam moments of local experts 0 and 1 swapped as they
    are read from each file (checkpoint.resharded): fp32 at EP=1 x DP=2 step-4 loss 5.780517 vs
    5.780540 (3.9e-6), norm 3.60880 vs 3.60443, weights 0.153 from the reference, failed; bf16
    step-4 norm 3.1e-3 from the straight run's, weights 0.153, failed. On the per-tensor
    resharding: the moments not cut into this rank's shards (left zero): fp32 step-4 loss
    5.783036 vs 5.780540 (4.3e-4), weights 0.160; bf16 step-4 norm 3.845 vs 3.598, weights 0.160."""
    mixtral = two_rank_runs["mixtral"]
    straight = mixtral[TWO_RANKS["mixtral_ep2"][1]]
    resumed = {"ep1_dp2": straight["resumed_at"][EP1], "one process": resumed_in_one_process(straight, tmp_path)}
    for name, run in resumed.items():
        assert_resumed_continues(run, straight, mixtral["reference"], f"megatron mixtral ep2 resumed at {name}")
    bf16 = mixtral[MIXTRAL_BF16]
    run = bf16["resumed_at"][f"{EP1},dtype=bfloat16"]
    figures = {f"step {SAVED_AFTER + i} {what}": rel_diff(got, want) for what in ("losses", "grad_norms")
               for i, (got, want) in enumerate(zip(run[what], bf16[what][SAVED_AFTER:], strict=True))}
    figures["weights after step 5"] = relative_error(run["weights"], bf16["weights"])
    shown = "; ".join(f"{what} {value:.2e}" for what, value in figures.items())
    print(f"\nmegatron mixtral bf16 ep2 resumed at ep1_dp2 vs straight: {shown}")
    assert figures[f"step {SAVED_AFTER} losses"] <= RESUMED_LOSS_RTOL, shown
    assert figures[f"step {SAVED_AFTER} grad_norms"] <= RESUMED_LOSS_RTOL, shown
    assert max(figures.values()) <= BF16_STEP, shown
    assert run["lrs"] == bf16["lrs"][SAVED_AFTER:] and run["global_steps"] == 5


@pytest.mark.slow
def test_megatron_pp2_cli_run_on_torchrun_and_ray_equals_one_process_deepspeed_and_exports(
        tmp_path, tiny_chat_model, chat_rows):
    """The real CLI on real chat rows: PP=2 over 2 ranks (1F1B) vs the DeepSpeed engine in one
    process, 3 steps, validation, export: the same counts, loss, unclipped grad norm and val
    loss within 1e-5, the exported Hugging Face weights within 1e-6. (Measured on the 2-layer
    SmolLM2 by hand: grad norms within 8.1e-8, losses equal, export 8.5e-9; before the padding
    row was kept still the 1-process run's step-1 grad norm was 1.8e-5 off.) The same PP=2 run
    on 2 Ray workers (hpsft.train_ray, a local Ray instance of its own) equals the torchrun one
    (measured by hand: every logged loss and grad norm equal to the last digit). Planted: the
    padding row's lookups left in its gradient (keep_padding_row_still not registered): step-1
    grad norm 2.240 vs 1.568, failed; the Ray driver's loss-token count doubled
    (hpsft/ray/data_parallel.py): Ray's step-1 grad norm 0.784 vs torchrun's 1.568, failed."""
    train, val = chat_parquet(tmp_path, chat_rows)
    megatron_pp2 = {"engine.name": "megatron", "engine.pipeline_parallel_size": 2}
    runs = {}
    for name, nproc, extra in (("deepspeed", 1, {}), ("megatron", 2, megatron_pp2)):
        runs[name] = tmp_path / name
        assert_ok(run_cli("hpsft.train", base_overrides(tiny_chat_model, train, val, runs[name], **{
            "trainer.total_steps": 3, "trainer.val_every": 3, **extra}), nproc=nproc))
    runs["megatron on ray"] = tmp_path / "megatron_on_ray"
    assert_ok(subprocess.run(
        cli_command("hpsft.train_ray", base_overrides(tiny_chat_model, train, val, runs["megatron on ray"], **{
            "trainer.total_steps": 3, "trainer.val_every": 3, **megatron_pp2, **RAY_WORKERS})),
        cwd=REPO, env={**ray_env(), "RAY_TMPDIR": private_ray_tmpdir()}, capture_output=True, text=True, timeout=600))
    assert_same_steps(train_steps(runs["megatron"]), train_steps(runs["deepspeed"]), [1, 2, 3], rtol=1e-5)
    assert_same_steps(train_steps(runs["megatron on ray"]), train_steps(runs["megatron"]), [1, 2, 3], rtol=1e-6)
    vals = [read_metrics(runs[name])[-1]["val/loss"] for name in runs]
    assert rel_diff(vals[1], vals[2]) < 1e-6 and rel_diff(vals[0], vals[1]) < 1e-5, vals
    assert max_rel_weight_diff(weights(runs["deepspeed"]), weights(runs["megatron"])) < 1e-6
    assert max_rel_weight_diff(weights(runs["megatron"]), weights(runs["megatron on ray"])) < 1e-6


def write_tiny_chat_mixtral(folder, tokenizer_from) -> str:
    """tiny_chat_model's shape as a Mixtral (4 experts, top 2, the router loss at 0.1, untied
    head) with SmolLM2's tokenizer and chat template."""
    import shutil

    import transformers

    from tests.conftest import TOKENIZER_FILES

    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=2,
        bos_token_id=1, eos_token_id=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1)).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_from) / name, Path(folder) / name)
    return str(folder)


@pytest.mark.slow
def test_megatron_ep2_cli_run_equals_two_rank_deepspeed(tmp_path, model_path, chat_rows):
    """MoE / EP through the CLI: write_tiny_chat_mixtral at engine.name=megatron
    engine.expert_parallel_size=2 on 2 ranks (EP=2 x DP=2: experts 0-1 on rank 0, 2-3 on rank
    1) against DeepSpeed on 2 ranks (DP=2: the same rows on each rank), 2 steps of chat rows and
    validation: the counts, loss, unclipped grad norm, router loss and val loss within 1e-5.
    Measured: losses and router losses equal to every logged digit, grad norms 2.2e-7, val loss
    1.3e-8. Planted: the Megatron engine's router loss dropped (router_aux_loss_coef = 0 in
    engine.initialize): step-1 grad norm 1.61235 vs 1.62414 (7.3e-3), step-2 loss 10.73457 vs
    10.73579, no router-loss metric logged; failed."""
    model = write_tiny_chat_mixtral(tmp_path / "mixtral", model_path)
    train, val = chat_parquet(tmp_path, chat_rows)
    runs = {"deepspeed": {}, "megatron": {"engine.name": "megatron", "engine.expert_parallel_size": 2}}
    for name, extra in runs.items():
        assert_ok(run_cli("hpsft.train", base_overrides(model, train, val, tmp_path / name, **{
            "trainer.total_steps": 2, "trainer.val_every": 2, "trainer.export_hf": "false", **extra}), nproc=2))
    megatron, deepspeed = train_steps(tmp_path / "megatron"), train_steps(tmp_path / "deepspeed")
    keys = ("train/grad_norm", "train/router_aux_loss")
    print("\nmegatron ep2 vs deepspeed (grad norms, router losses):",
          {step: [run[step].get(key) for key in keys for run in (megatron, deepspeed)] for step in (1, 2)})
    assert_same_steps(megatron, deepspeed, [1, 2], rtol=1e-5)
    for step in (1, 2):
        assert rel_diff(megatron[step]["train/router_aux_loss"], deepspeed[step]["train/router_aux_loss"]) < 1e-5
    vals = [read_metrics(tmp_path / name)[-1]["val/loss"] for name in runs]
    assert rel_diff(*vals) < 1e-5, vals


# name: the variant of tests/dist_scripts/capture_step_grads.py; one 2-rank launch runs both.
BF16_LAYOUTS = {"dp2": "engine.name=megatron engine.tensor_parallel_size=1",
                "tp2": "engine.name=megatron engine.tensor_parallel_size=2"}


@pytest.fixture(scope="module")
def bf16_steps(tmp_path_factory, tiny_chat_model, sequences) -> dict:  # noqa: F811
    """layout -> micro-batches -> the captured step (capture_step_grads.py): the 8 sequences
    of test_precision over the replicas, one step split into 1 and into 4 micro-batches per
    replica, engine.dtype=bfloat16."""
    root = tmp_path_factory.mktemp("megatron_bf16")
    torch.save(sequences, root / "sequences.pt")
    proc = run_cli(None, [str(root / "sequences.pt"), str(root / "grads.pt"), "1,4", ";".join(BF16_LAYOUTS.values()),
                          f"model.path={tiny_chat_model}", "engine.dtype=bfloat16"], nproc=2,
                   script=str(REPO / "tests" / "dist_scripts" / "capture_step_grads.py"))
    assert_ok(proc)
    steps = torch.load(root / "grads.pt")
    return {name: steps[variant] for name, variant in BF16_LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", BF16_LAYOUTS)
def test_megatron_bf16_accumulates_and_reduces_gradients_in_fp32(bf16_steps, name):
    """engine.dtype=bfloat16 on tiny_chat_model at DP=2 and TP=2, with 1 and 4 micro-batches
    per replica, checked as test_precision checks DeepSpeed: bf16 weights, fp32 master weights
    (most off the bf16 grid after the step), fp32 gradient buffers, and the step's gradient
    (Megatron's main_grad after accumulation and the DP reduce-scatter) against the fp64 sum of
    each row's own bf16 gradient taken by the same engine (capture_step_grads.rows_sum): the
    bound is fp32 rounding, not bf16's (1e-6). Planted: DDP's grad_reduce_in_fp32=False in
    engine.py (bf16 grad buffers, so bf16 accumulation and reduction): against the rows' sum
    dp2 1.00e-3 (1 mb) and 1.74e-3 (4 mb), tp2 0 (1 mb: nothing to add) and 1.48e-3 (4 mb);
    all but tp2's 1 mb beyond the 1e-6 bound; 1 vs 4 mb 2.19e-3 (dp2, beyond 2e-3) and 1.98e-3
    (tp2, within it). Failed (that run asserted the buffers' dtype first: bf16 and fp32; the
    figures were printed before any assertion)."""
    steps = bf16_steps[name]
    figures = {}  # all measured first: a failure shows every one
    for k, step in steps.items():
        figures[f"grad vs fp64 sum of bf16 rows, {k} mb"] = relative_error(step["grads"], step["rows_sum"])
    figures["grad 1 vs 4 mb"] = relative_error(steps[4]["grads"], {k: g.double() for k, g in steps[1]["grads"].items()})
    figures["loss 1 vs 4 mb"] = rel_diff(steps[1]["loss"], steps[4]["loss"])
    shown = "; ".join(f"{what} {value:.2e}" for what, value in figures.items())
    print(f"\nmegatron bf16 {name}: {shown}; masters beyond bf16 "
          f"{[round(step['masters_beyond_bf16'], 4) for step in steps.values()]}")
    for k, step in steps.items():
        # Accumulation and reduction add fp32 rounding only (measured 6.1e-9 / 1.6e-8 at DP=2,
        # 0 / 9.8e-9 at TP=2, with 1 / 4 micro-batches).
        assert figures[f"grad vs fp64 sum of bf16 rows, {k} mb"] < 1e-6, shown
        # bf16 weights but the RMSNorms' (Megatron's WrappedTorchNorm builds torch.nn.RMSNorm
        # without params_dtype: fp32 weights, bf16 outputs); fp32 gradient buffers; fp32 masters
        # (measured: all of them off the bf16 grid after the step).
        assert step["weight_dtypes"] == ["torch.bfloat16", "torch.float32"], step["weight_dtypes"]
        assert step["fp32_weights"] and all("layernorm" in n for n in step["fp32_weights"]), step["fp32_weights"]
        assert step["grad_dtypes"] == ["torch.float32"], step["grad_dtypes"]
        assert step["masters_beyond_bf16"] > 0.5, step["masters_beyond_bf16"]
        assert 0 < step["loss"] < 20, step["loss"]
    # 1 vs 4 micro-batches: 1.4e-3 apart (bf16 backward passes over differently packed rows
    # round differently), as for DeepSpeed; the losses (fp32 sums) 1.4e-8 / 2.7e-8.
    assert figures["grad 1 vs 4 mb"] < 2e-3, shown
    assert figures["loss 1 vs 4 mb"] < 5e-3, shown


@pytest.mark.parametrize("keys, message", [
    ({"sequence_parallel_size": 2}, "no sequence parallelism"),
    ({"offload_optimizer": True}, "ZeRO-Offload"),
])
def test_megatron_engine_config_refuses_what_it_has_not(keys, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(name="megatron", **keys)


def test_megatron_engine_refuses_lora_and_dora():
    with pytest.raises(ValueError, match="model.lora.rank=8 with engine.name=megatron"):
        load_config(None, ["engine.name=megatron", "model.lora.rank=8"])
    with pytest.raises(ValueError, match="model.lora.rank=8, model.lora.use_dora=true with engine.name=megatron"):
        load_config(None, ["engine.name=megatron", "model.lora.rank=8", "model.lora.use_dora=true"])


@pytest.mark.slow
def test_the_tp3_worked_config_trains_smollm2_as_one_deepspeed_process(tmp_path, model_path, chat_rows):
    """configs/megatron_tp3.yaml as its header runs it (3 ranks), on the 2-layer SmolLM2 (9 and
    3 heads: TP=3 is its layout) and the test's chat rows, 2 steps: the counts, loss and
    unclipped grad norm of each step and the final val loss equal one DeepSpeed process's run
    of the same config (engine.name=deepspeed) within 1e-5. Planted: the vocabulary-parallel
    loss's d(hidden) not summed over TP (head_loss without sum_grad_over_tp): step-1 grad norm
    19.70 vs 29.88."""
    train, val = chat_parquet(tmp_path, chat_rows)
    config = ["--config", str(REPO / "configs" / "megatron_tp3.yaml")]
    runs = {"megatron tp3": (3, {}), "deepspeed": (1, {"engine.name": "deepspeed", "engine.tensor_parallel_size": 1})}
    for name, (nproc, extra) in runs.items():
        overrides = base_overrides(model_path, train, val, tmp_path / name, **{
            "trainer.total_steps": 2, "trainer.val_every": 2, "trainer.export_hf": "false", **extra})
        assert_ok(run_cli("hpsft.train", config + overrides, nproc=nproc))
    assert_same_steps(train_steps(tmp_path / "megatron tp3"), train_steps(tmp_path / "deepspeed"), [1, 2], rtol=1e-5)
    vals = [read_metrics(tmp_path / name)[-1]["val/loss"] for name in runs]
    assert rel_diff(*vals) < 1e-5, vals


def write_deep_llama(folder):
    """A 12-layer Llama, 256 wide, MLP 1024, untied head, vocabulary 2048: 12.8M parameters
    (49 MiB in fp32), no tensor above 2 MiB, so one whole-model copy stands out of the noise."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.alone
def test_resharding_a_checkpoint_holds_one_tensor_at_a_time(tmp_path):
    """write_deep_llama's TP=2 checkpoint (2 ranks, one step) resumed at TP=1 in one process
    (tests/dist_scripts/megatron_reshard_memory.py, cold starts): the load's peak RssAnon above
    its start stays below one fp32 copy of the model (checkpoint.resharded builds one Hugging
    Face tensor's masters and moments at a time; the resumed steps it gives are
    test_megatron_checkpoint_resumes_at_other_layouts'). Measured: start 550.4 MiB, peak 649.2
    (+98.8: Adam's moments, 2 x 49.0 MiB, and ~1 MiB more). The bug it is for, the whole-model
    resharding before this one (three flat fp32 copies of every Hugging Face tensor and int64
    element places of every shard): peak +336.0 MiB, failed."""
    model = write_deep_llama(tmp_path / "model")
    script = str(REPO / "tests" / "dist_scripts" / "megatron_reshard_memory.py")
    ckpt, out = tmp_path / "ckpt", tmp_path / "memory.json"
    assert_ok(run_cli(None, ["save", str(model), str(ckpt), TP2], nproc=2, script=script, preloaded=False))
    assert_ok(run_cli(None, ["load", str(model), str(ckpt), EP1, str(out)], nproc=1, script=script,
                      preloaded=False))
    memory = json.loads(out.read_text())
    rise = memory["load"]["peak"] - memory["load"]["start"]
    print(f"\nresharding TP=2 -> TP=1: RssAnon MiB {memory['load']}, peak rise {rise:.1f} MiB; model "
          f"{memory['model_mib']:.1f} MiB fp32, largest tensor {memory['largest_tensor_mib']:.2f} MiB")
    # The load leaves Adam's two fp32 moments (absent before: the engine has taken no step), 2x
    # the model at TP=1; one more model copy of room for a tensor's temporaries and the allocator.
    assert rise < 3 * memory["model_mib"], memory
