"""Ulysses sequence parallelism (engine.sequence_parallel_size, docs/sequence_parallel.md).

How a packed row is cut (one process), the head-count refusal, two optimizer steps of
real DeepSpeed engines over 2 gloo ranks laid out as DP=1 x SP=2 and DP=2 x SP=1 against
one process without DeepSpeed on the same packed rows, and the real CLI trained with SP=2
and resumed with SP=1, on a tiny random GQA Llama.
"""

import shutil
import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpsft.data.batch import IGNORE_INDEX, collate_jagged, packed_row, shifted_labels
from hpsft.data.sequence_split import real_tokens, split_row
from hpsft.utils.errors import UserInputError
from hpsft.models.ulysses_attention import check_heads
from tests.conftest import (REPO, assert_same_steps, base_overrides, chat_parquet, ray_env, read_metrics, rel_diff, run_cli,
                            train_steps)
from tests.numerics import relative_error

SCRIPT = str(REPO / "tests" / "dist_scripts" / "sequence_parallel_steps.py")
VOCAB = 512


def tiny_llama(folder, heads: int = 4, kv_heads: int = 2, vocab: int = VOCAB) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                         max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def tiny_gpt_oss(folder) -> str:
    """GPT-OSS: attention sinks (one logit per query head), a sliding window of 8 on layer 0
    (the step's rows run up to 58 tokens), 2 experts. Sinks far from zero and different per
    head: a rank given another rank's sinks computes another attention."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                          tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([-1.5, 2.0, 0.5, 3.0]))
    model.save_pretrained(folder)
    return str(folder)


def sequence(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[: n // 3] = False  # a prompt part, unsupervised
    return {"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "loss_mask": loss_mask}


def row_of(lengths: list[int]) -> dict:
    return packed_row(collate_jagged([{**sequence(n, i), "index": i} for i, n in enumerate(lengths)]))


@pytest.mark.parametrize("lengths, sp, cut", [
    ([40, 9, 7], 2, "inside the 40-token sequence, longer than half the row"),
    ([12, 12], 2, "at the boundary of the two sequences"),
    ([13, 1], 2, "around a sequence shorter than SP, after padding to 14"),
    ([1, 6, 4], 3, "inside the second sequence, the row padded from 11 to 12"),
])
def test_a_row_cut_across_the_group_keeps_every_label_and_position(lengths, sp, cut):
    row = row_of(lengths)
    slices = [split_row(row, r, sp) for r in range(sp)]
    total = sum(lengths)
    padded = -(-total // sp) * sp
    labels = torch.cat([s["labels"] for s in slices])
    # The slices put back together are the row, its labels taken before the cut, padded with
    # unsupervised tokens that continue the last sequence's positions.
    assert torch.equal(labels[:total], shifted_labels(row["input_ids"][0], row["loss_mask"], row["offsets"]))
    assert (labels[total:] == IGNORE_INDEX).all() and labels.numel() == padded
    assert torch.equal(torch.cat([s["input_ids"][0] for s in slices])[:total], row["input_ids"][0])
    positions = torch.cat([s["position_ids"][0] for s in slices])
    assert torch.equal(positions[:total], row["position_ids"][0])
    assert torch.equal(positions[total:], row["position_ids"][0, -1] + torch.arange(1, padded - total + 1))
    for r, s in enumerate(slices):
        assert s["slice_start"] == r * padded // sp and s["input_ids"].shape == (1, padded // sp)
        # Every rank holds the whole padded row's tokens too (a vision model places its images by them).
        assert torch.equal(s["row_input_ids"][0], torch.cat([t["input_ids"][0] for t in slices]))
        assert s["offsets"].tolist() == [*row["offsets"][:-1].tolist(), padded]  # the whole row's, for attention
    assert sum(real_tokens(total, r, sp) for r in range(sp)) == total
    # A slice's last position predicts the token that opens the next slice (within a sequence).
    cut_at = padded // sp
    inside = cut_at not in row["offsets"].tolist()
    assert (slices[0]["labels"][-1] == row["input_ids"][0, cut_at]) == (inside and bool(row["loss_mask"][cut_at]))


def test_a_head_count_not_divisible_by_sp_is_refused_with_the_numbers():
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)  # SmolLM2-135M's heads
    with pytest.raises(UserInputError, match=r"sequence_parallel_size=2 does not divide the model's 9 attention "
                                             r"heads \(3 key/value heads\).*\[1, 3, 9\]"):
        check_heads(config, 2)
    check_heads(config, 3)


def test_tiled_mlps_give_the_untiled_gradients_in_tiles(tmp_path):
    """One process: MLPs in tiles of at most 8 tokens over a 57-token row give the untiled loss
    and gradients, running each projection once per tile in the forward and again in the backward."""
    from hpsft.models import PackedCausalLM, load_causal_lm
    from hpsft.models.tiled_mlp import tile_mlps

    path = tiny_llama(tmp_path / "model")
    row = row_of([40, 9, 8])
    results = []
    for tiled in (False, True):
        model = PackedCausalLM(load_causal_lm(path)).train()
        calls = []
        model.lm.get_decoder().layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[-2]))
        if tiled:
            tile_mlps(model.lm, 8)
        out = model(**row)
        out["loss"].backward()
        results.append((float(out["loss"].detach()), {k: p.grad for k, p in model.named_parameters()}, calls))
    (loss, grads, calls), (tiled_loss, tiled_grads, tiled_calls) = results
    # ceil(57 / 8) = 8 tiles, as even as possible; run in the forward, then recomputed in the backward.
    assert calls == [57] and tiled_calls == ([8] + [7] * 7) * 2
    assert abs(tiled_loss - loss) <= 1e-6 * abs(loss) and relative_error(tiled_grads, grads) < 1e-6


def one_process_step(model_path: str, samples: list[dict], rows: list[list[int]]) -> tuple[float, dict]:
    """(loss, gradients) of one step on whole packed rows, without DeepSpeed or SP."""
    from hpsft.models import PackedCausalLM, load_causal_lm

    model = PackedCausalLM(load_causal_lm(model_path)).train()
    packed = [packed_row(collate_jagged([{**samples[i], "index": i} for i in row])) for row in rows]
    total = sum(int(shifted_labels(r["input_ids"][0], r["loss_mask"], r["offsets"]).ne(IGNORE_INDEX).sum())
                for r in packed)
    loss = 0.0
    for r in packed:
        out = model(**r)
        (out["loss"] / total).backward()
        loss += float(out["nll"]) / total
    return loss, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.slow
def test_sp2_trains_as_sp1_under_every_zero_stage(tmp_path):
    """2 ranks: DP=1 x SP=2 (ZeRO 0-3; GQA with 2 key/value heads, and with 1 repeated
    to the 4 query heads; with activation checkpointing, which repeats the all-to-all in the
    recomputation; with tiled MLPs, also at DP=2, under ZeRO-3 with an agreed tile count and
    under ZeRO-2 without; GPT-OSS with attention sinks) vs DP=2 x SP=1 on the same global
    batches, two steps each; step 1 also against one process on the same (untiled) packed rows.
    Planted: GPT-OSS's sinks passed whole after the all-to-all (RuntimeError in explicit_attention,
    the defect this layout was added for); every rank given rank 0's sinks: step-1 loss off by
    3.0e-5, gradients by 6.3e-2; the tile count decided by every layer's MLP (TileCount not
    kept for the forward): twice the forwards' tile counts (2 layers), failed."""
    gqa = tiny_llama(tmp_path / "gqa")
    one_kv = tiny_llama(tmp_path / "one_kv", kv_heads=1)
    sinks = tiny_gpt_oss(tmp_path / "gpt_oss")
    # Step 1's rows: cut inside a sequence longer than half its row (and padded from 57 to 58),
    # at a sequence boundary, around a 1-token sequence, and inside a short one.
    lengths = [40, 9, 8, 12, 12, 13, 1, 6, 11, 30, 7, 5, 21, 16]
    samples = [sequence(n, seed) for seed, n in enumerate(lengths)]
    steps = [[[0, 1, 2], [3, 4], [5, 6], [7, 8]], [[9, 10], [11, 12], [13], [0, 6]]]
    layouts = [{"name": "zero0 sp2", "model": gqa, "zero_stage": 0, "sp": 2},
               {"name": "zero1 sp2", "model": gqa, "zero_stage": 1, "sp": 2},
               {"name": "zero2 sp2", "model": gqa, "zero_stage": 2, "sp": 2},
               {"name": "zero3 sp2", "model": gqa, "zero_stage": 3, "sp": 2},
               {"name": "zero2 dp2", "model": gqa, "zero_stage": 2, "sp": 1},
               {"name": "one kv head, zero2 sp2", "model": one_kv, "zero_stage": 2, "sp": 2},
               {"name": "checkpointing, zero2 sp2", "model": gqa, "zero_stage": 2, "sp": 2, "checkpointing": True},
               # MLPs in tiles of 8 tokens; with DP=2 the ranks' rows differ in length and agree on a count.
               {"name": "tiled mlp, zero3 sp2", "model": gqa, "zero_stage": 3, "sp": 2, "tiled_mlp_tokens": 8},
               {"name": "tiled mlp, zero3 dp2", "model": gqa, "zero_stage": 3, "sp": 1, "tiled_mlp_tokens": 8},
               # Outside ZeRO-3 each rank tiles its own row (different counts, no collective).
               {"name": "tiled mlp, zero2 dp2", "model": gqa, "zero_stage": 2, "sp": 1, "tiled_mlp_tokens": 8},
               # Each rank attends with 2 of the 4 heads: it must take those heads' sinks.
               {"name": "gpt-oss sinks, zero2 sp2", "model": sinks, "zero_stage": 2, "sp": 2}]
    torch.save({"sequences": samples, "steps": steps, "layouts": layouts}, tmp_path / "spec.pt")
    proc = run_cli(None, [str(tmp_path / "spec.pt"), str(tmp_path / "out.pt")], nproc=2, script=SCRIPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    runs = torch.load(tmp_path / "out.pt")
    references = {path: one_process_step(path, samples, steps[0]) for path in (gqa, one_kv, sinks)}
    figures = {}  # all measured first: a failure shows every one
    for layout in layouts:
        loss, grads = references[layout["model"]]
        run = runs[layout["name"]]
        figures[f"{layout['name']}: step-1 loss vs one process"] = abs(run["losses"][0] - loss) / loss
        figures[f"{layout['name']}: step-1 grads vs one process"] = relative_error(run["grads"], grads)
    for layout in layouts:  # of the same model (the one-KV-head model is another)
        if layout["model"] == gqa and layout["name"] != "zero2 dp2":
            figures[f"{layout['name']}: step-2 loss vs zero2 dp2"] = abs(
                runs[layout["name"]]["losses"][1] - runs["zero2 dp2"]["losses"][1])
    shown = "; ".join(f"{name} {value:.1e}" for name, value in figures.items())
    print(shown)
    assert all(value < 1e-5 for value in figures.values()), shown
    # A tiled forward decides its tile count once (under ZeRO-3: one all-reduce per forward, not per layer).
    for layout in layouts:
        if layout.get("tiled_mlp_tokens"):
            run = runs[layout["name"]]
            assert run["tile_counts"] == run["forwards"] > 0, (layout["name"], run["tile_counts"], run["forwards"])
    # The second step trained on updated weights: the layouts agree on more than the start.
    assert abs(runs["zero2 dp2"]["losses"][1] - runs["zero2 dp2"]["losses"][0]) > 1e-3


@pytest.fixture(scope="module")
def sp2_run(tmp_path_factory, tiny_chat_model, chat_rows):
    """A DP=1 x SP=2 CLI run of 3 steps (token-budget rows, validation, a checkpoint per
    step) on a 4-head GQA model with SmolLM2's tokenizer, and the overrides that made it."""
    root = tmp_path_factory.mktemp("sp2_run")
    train, val = chat_parquet(root, chat_rows, train=16, val=4)

    def overrides(out, **extra):
        return base_overrides(tiny_chat_model, train, val, out, **{
            "data.max_tokens_per_micro_batch": 256, "trainer.total_steps": 3, "trainer.save_every": 1,
            "trainer.export_hf": "false", **extra})

    out = root / "sp2"
    proc = run_cli("hpsft.train", overrides(out, **{"engine.sequence_parallel_size": 2}), nproc=2)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "world size 2, 1 node(s), 2 rank(s) per node; data-parallel size 1 x sequence-parallel size 2" in proc.stdout
    return out, overrides


def assert_same_steps_2_and_3(straight_run, resumed_run) -> None:
    """The resumed run's steps 2 and 3 are the straight SP=2 run's: the token counts every rank's
    shares (its slices') add up to, loss, unclipped gradient norm (step 2's at the weights both
    loaded, step 3's after an update of each) and the final validation loss (1e-5: the slices'
    sums are added in another order)."""
    straight, resumed = train_steps(straight_run), train_steps(resumed_run)
    assert sorted(resumed) == [2, 3]
    assert_same_steps(resumed, straight, [2, 3], rtol=1e-5)
    assert rel_diff(straight[3]["val/loss"], resumed[3]["val/loss"]) <= 1e-5


@pytest.mark.slow
def test_an_sp2_checkpoint_resumes_with_sp1(tmp_path, sp2_run):
    """The step-1 checkpoint of the SP=2 run, resumed by one process (SP=1; the ZeRO shards of
    2 ranks converted), trains steps 2 and 3 as the SP=2 run did: the gradients of SP=2 through
    TrainingWorker (its loss-token count over the SP group) against SP=1's.
    Planted: the worker's `// self.sp_size` on the all-reduced loss-token count dropped (SP=2
    counts every token twice): SP=2's grad norms half of SP=1's at steps 2 and 3 (rel diff 0.5),
    step 3's loss 3.1e-5 off (step 2's, a forward at the loaded weights, equal). Planted: SP's
    padding counted in train/tokens (`tokens` from the padded rows' numel in
    TrainingWorker.train_batch): step 2's train/tokens 396 (SP=2) vs 395 (SP=1)."""
    sp2, overrides = sp2_run
    checkpoint = sp2 / "checkpoints" / "global_step_1"
    resumed = tmp_path / "resumed"
    proc = run_cli("hpsft.train", overrides(resumed, **{"trainer.resume": checkpoint}))
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"resumed from {checkpoint} at step 1 (written by a spmd run with 1 data-parallel ranks, now 1)" \
        in proc.stdout
    assert_same_steps_2_and_3(sp2, resumed)
    # SP pads each row to a multiple of 2 tokens; one process has no padding.
    assert read_metrics(sp2)[-1]["perf/padding_efficiency"] < read_metrics(resumed)[-1]["perf/padding_efficiency"] == 1


@pytest.mark.slow
def test_an_sp2_checkpoint_resumes_on_ray_with_sp2(tmp_path, sp2_run):
    """The same checkpoint resumed by a Ray driver over 2 workers with SP=2 (the driver counts
    the loss tokens): the same steps 2 and 3.
    Planted: the driver's count doubled (hpsft/ray/data_parallel.py): grad norms of steps 2 and
    3 half the SPMD run's, step 3's loss 7.3e-5 off."""
    sp2, overrides = sp2_run
    on_ray, ray_tmp = tmp_path / "ray", tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must be short
    try:
        proc = run_cli("hpsft.train_ray", overrides(on_ray, **{
            "trainer.resume": sp2 / "checkpoints" / "global_step_1", "engine.sequence_parallel_size": 2,
            "ray.n_workers_per_node": 2, "ray.cpus_per_worker": 0.5}),
            env={**ray_env(), "RAY_TMPDIR": ray_tmp})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert_same_steps_2_and_3(sp2, on_ray)
