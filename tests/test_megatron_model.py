"""The Megatron-Core model layer (hpsft/engine/megatron, docs/megatron.md): the GPTModel built
from a Hugging Face config computes the Hugging Face model's own loss and gradients on packed
rows, at one process and at each parallel layout; its weights go there and back bit for bit;
what it cannot compute exactly is refused by name.

The multi-rank checks run in two launches of tests/dist_scripts/megatron_model_checks.py (one
process; 4 ranks for every layout), on the tiny random models of tests/megatron_models.py.
"""

import importlib.util
import json
import subprocess
import sys

import pytest
import transformers

from hpsft.engine.megatron.architecture import architecture_of, check_layout
from hpsft.models.families import UnsupportedModel
from tests.conftest import REPO, run_cli
from tests.megatron_models import SMALL, VOCAB

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed (the Makefile installs it)")

SCRIPT = str(REPO / "tests" / "dist_scripts" / "megatron_model_checks.py")
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe"]
# The relative error allowed in the loss and in each Hugging Face tensor's gradient (fp32: the
# two paths sum in different orders; measured <= 1.1e-6).
TOLERANCE = 1e-5


def run_checks(tmp_path, nproc: int, cases: list[str]) -> dict:
    out = tmp_path / "results.json"
    proc = run_cli(None, [str(out), *cases], nproc=nproc, script=SCRIPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(out.read_text())
    for case, r in results.items():
        print(case, f"loss {rel(r['loss'], r['reference_loss']):.1e}, worst grad {r['worst_grad_error']:.1e} "
              f"({r['worst_grad']}), grad norm {rel(r['grad_norm'], r['reference_grad_norm']):.1e}, worst weight "
              f"after the step {r['worst_weight_error']:.1e} ({r['worst_weight']})")
    return results


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_equal_to_the_reference(case: str, r: dict) -> None:
    assert rel(r["loss"], r["reference_loss"]) <= TOLERANCE, (case, r)
    assert r["worst_grad_error"] <= TOLERANCE, (case, r["worst_grad"], r["worst_grad_error"])
    assert r["round_trip_mismatches"] == [], (case, r["round_trip_mismatches"])
    assert rel(r["grad_norm"], r["reference_grad_norm"]) <= TOLERANCE, (case, r["grad_norm"], r["reference_grad_norm"])
    assert r["worst_weight_error"] <= TOLERANCE, (case, r["worst_weight"], r["worst_weight_error"])
    # The LM-head shards' real rows tile the vocabulary exactly; their padded rows are zero.
    shards = sorted(r["head_shards"])
    assert [s[1] for s in shards] == [sum(s[2] for s in shards[:i]) for i in range(len(shards))], shards
    assert sum(s[2] for s in shards) == VOCAB and all(s[3] for s in shards), shards


@needs_megatron
@pytest.mark.slow
def test_one_process_equals_the_hf_models_own_forward_on_each_sequence(tmp_path):
    """One process, every family (Llama with a tied head and llama3 RoPE scaling, Qwen2 with
    q/k/v bias and a sliding window on layer 1, Qwen3 with q/k norm, Mistral's window, Mixtral
    and Qwen2-MoE's gated shared expert with the family's router loss on, its coefficient 0.1):
    4 packed rows of 10 uneven sequences through Megatron's
    schedule with hpsft's vocabulary-parallel fused loss on the final hidden states and the
    LM-head shard; loss and every gradient (gathered back to Hugging Face names) equal the Hugging
    Face model's eager forward on each sequence alone; the weights, read from the model's
    save_pretrained folder (MoE experts in the checkpoint's per-expert layout, fused on load), go
    there and back bit-identical;
    one step of Megatron's distributed optimizer (Adam, clipped) gives torch AdamW's weights on
    the reference's gradients, and its unclipped gradient norm is theirs.
    Seen once, and this launch failed: the optimizer groups' weight decay left at the base value
    (Megatron's LR scheduler sets it from wd_mult; without it 1-D weights decay too): weights
    1.0e-3 off. Planted once each, and this launch failed (relative errors, loss / worst
    gradient):
    q/k/v placed [all q; all k; all v] instead of per query group (convert.qkv_pieces): Llama
    6.2e-3 / 59, Qwen3 6.0e-4 / 2.0; gate and up swapped (convert.gated_fc1_pieces): Llama
    9.4e-5 / 0.21, Mixtral 3.9e-5 / 0.30; Megatron's own RoPE frequencies instead of the HF
    model's (the llama3 scaling dropped, model.build_model): Llama 3.3e-6 / 0.24 (the loss alone
    would have passed); the padded vocabulary rows made classes of the loss (HeadShard.vocab_size
    = the padded size): 4.2e-3 / 6.1e-3 (also at TP=2); attention across the row's sequences (PackedCoreAttention
    without cu_seqlens): Llama 3.6e-3 / 1.0, Qwen3 1.3e-3 / 1.2; the sliding window dropped:
    Qwen2 1.4e-4 / 0.70, Mistral 1.2e-3 / 0.58; the router loss of the first MoE layer's logits
    only (model.router_aux_loss): Mixtral 1.5e-3 / 2.5, Qwen2-MoE 1.1e-2 / 3.5. Not a bug: positions running on across the
    row's sequences (max_seqlen = the row's length sends Megatron's THD RoPE down its
    offset path) passed (3.8e-8 / 5.8e-7): RoPE rotates by position, attention within a
    sequence sees only position differences, so a per-sequence offset cancels; sequences
    attending to each other is what shows (above)."""
    results = run_checks(tmp_path, 1, [f"{family}:1,1,1" for family in FAMILIES])
    for case, r in results.items():
        assert_equal_to_the_reference(case, r)


@needs_megatron
@pytest.mark.slow
def test_every_parallel_layout_equals_the_hf_models_own_forward(tmp_path):
    """4 ranks: TP=2 (x DP=2), PP=2 (x DP=2; 1F1B over 2 micro-batches a replica), TP=2 x PP=2
    (4 micro-batches) for Llama (tied: the last stage's copy of the embedding) and Qwen3; EP=2
    (x DP=4: the experts' all-to-all over gloo between data-parallel ranks) for Mixtral and
    Qwen2-MoE with their router loss, EP=2 x PP=2 for Mixtral without it (refused with it). Each as the one-process test, data-parallel ranks on their own rows, gradients
    summed by Megatron's DDP and finalize_model_grads.
    Planted once each, and its case failed (run in a 2-rank launch of the same script): a
    layer's pipeline stage reversed (convert.pieces: the last stage given the first stage's
    layers): llama PP=2 loss 4.7e-4, gradient 1.3; every EP rank given experts 0..E/EP-1
    (convert.expert_pieces): mixtral EP=2 loss 9.1e-4, the experts' round trip wrong."""
    cases = [f"{family}:{layout}" for family in ("llama", "qwen3") for layout in ("2,1,1", "1,2,1", "2,2,1")]
    cases += ["mixtral:1,1,2", "mixtral_without_router_loss:1,2,2", "qwen2_moe:1,1,2"]
    results = run_checks(tmp_path, 4, cases)
    assert sorted(results) == sorted(cases)
    for case, r in results.items():
        assert_equal_to_the_reference(case, r)


REFUSED = [
    (lambda: transformers.Gemma2Config(**SMALL), 1, 1, 1, "model type 'gemma2' is not supported by engine.name=megatron"),
    (lambda: transformers.LlamaConfig(**SMALL, hidden_act="gelu"), 1, 1, 1, "hidden_act='gelu'"),
    (lambda: transformers.LlamaConfig(**SMALL, attention_bias=True), 1, 1, 1, "attention_bias=True"),
    (lambda: transformers.LlamaConfig(**SMALL, mlp_bias=True), 1, 1, 1, "mlp_bias=True"),
    (lambda: transformers.LlamaConfig(**SMALL, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     1, 1, 1, "rope_type='yarn'"),
    (lambda: transformers.MixtralConfig(**SMALL, output_router_logits=True, router_aux_loss_coef=0.01), 1, 2, 1,
     "engine.pipeline_parallel_size=2 with the MoE router loss"),
    (lambda: transformers.MixtralConfig(**SMALL, router_jitter_noise=0.1), 1, 1, 1, "router_jitter_noise=0.1"),
    (lambda: transformers.LlamaConfig(**SMALL), 4, 1, 1, "engine.tensor_parallel_size=4 must divide the attention heads"),
    (lambda: transformers.LlamaConfig(**SMALL), 1, 4, 1, "engine.pipeline_parallel_size=4 must divide the layers"),
    (lambda: transformers.LlamaConfig(**SMALL), 1, 1, 2, "engine.expert_parallel_size=2 needs an MoE model"),
    (lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4), 2, 1, 1,
     "engine.tensor_parallel_size=2 with an MoE model needs Megatron's sequence parallelism"),
    (lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4), 1, 1, 8,
     "engine.expert_parallel_size=8 must divide the experts (4)"),
]


@pytest.mark.parametrize("config, tp, pp, ep, message", REFUSED, ids=[r[-1][:40] for r in REFUSED])
def test_what_megatron_would_compute_differently_is_refused_by_name(config, tp, pp, ep, message):
    with pytest.raises(UnsupportedModel) as refusal:
        check_layout(architecture_of(config()), tp, pp, ep)
    assert message in str(refusal.value), str(refusal.value)


def test_hpsft_imports_and_reads_architectures_without_megatron():
    """megatron-core is optional: `import hpsft` (and the engines, and the architecture
    checks, which refuse without it) never imports it."""
    code = ("import sys, hpsft, hpsft.engine, hpsft.engine.megatron.architecture, hpsft.train; "
            "assert not any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules), 'megatron imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
