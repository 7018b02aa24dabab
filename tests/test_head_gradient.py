"""bf16 ZeRO-1: the fused loss sums d(lm_head.weight) in fp32 straight into DeepSpeed's
BF16_Optimizer gradient (hpsft/engine/deepspeed/head_gradient.py), through the real engine (gloo,
CPU) on a 2-layer Llama 64 wide with a 512-token vocabulary, head tied and untied
(tests/dist_scripts/head_gradient_steps.py runs the steps).

References, none of them this path:
- the head weight's gradient: an fp64 formula written here, sum over supervised rows of
  (softmax(h W^T) - onehot(label))^T h / loss tokens, from the hidden states h and bf16 head
  weight W each micro-batch's loss got (every rank's);
- a tied head's gradient: that formula plus the embedding gradient of an untied twin (the same
  weights, lm_head.weight a copy of the embedding): autograd's, which DeepSpeed's backward
  epilogue adds after the loss's forward-time sum;
- every other parameter: the path before (the loss returning d(weight) to autograd). The
  step has 64 loss tokens, so the loss's gradient scale is a power of two and both paths make
  bit-identical d(hidden): those gradients must agree exactly (measured: 0 apart);
- the updated weights: torch's AdamW applied here to the step-1 fp32 masters with the
  reference gradients, clipped as DeepSpeed clips.

The path before is *not* the reference for the head: it rounds each micro-batch's d(weight)
to bf16 before DeepSpeed's fp32 sum (1.7e-3 to 2.1e-3 relative off the formula here, against
6.5e-8 to 1.5e-7 for this path), and where a tied embedding's gradient or other micro-batches'
cancel an element that rounding can zero it or flip its sign, which Adam's sign-like first step
turns into whole-lr weight differences (7e-4 to 2e-3 relative on the head weight after the
step, measured).

Planted once each (one process unless said; the figure of the check that failed):
- grad_scale x the micro-batch count (the engine's loss_grad_scale), and (2 ranks) grad_scale
  without the dp factor: the op's upstream check raised in backward ("its gradients were made
  for grad_scale"), the run failed (the 2-rank one re-planted at 4 micro-batches alone: raised);
- the sum overwriting instead of adding (the first chunk's GEMM with beta=0 into the engine's
  buffer): head grad 0.87 relative off with 4 micro-batches (tied: 0.87, the earlier
  micro-batches' embedding gradients wiped too), weights 5.5e-2;
- the summed gradient dropped (the loss given a copy of DeepSpeed's buffer): head grad 1.0
  untied, 0.69 tied; grad norm 0.17;
- the buffer not marked as holding a gradient (mark_head_gradient skipped): DeepSpeed's
  reported norm 0.17 off untied, weights 9.5e-5 (the clip factor);
- the buffer not zeroed after step() (its pre-step value added back): step 3's head grad 1.97.
"""

import pytest
import torch

from tests.conftest import REPO, run_cli

SCRIPT = str(REPO / "tests" / "dist_scripts" / "head_gradient_steps.py")
HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
MICRO_BATCHES = (1, 4)
# At 2 ranks only 4 micro-batches: each rank's loss sums over several micro-batches and the
# ranks' sums are all-reduced, what 2 ranks add to the one process's (1, 4); the one micro-batch
# case is the one process's.
TWO_RANK_MICRO_BATCHES = (4,)
RTOL = 1e-6


def write_models(root):
    """A tied 2-layer Llama and its untied twin (same weights, lm_head.weight a copy)."""
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=True))
    tied.save_pretrained(root / "tied")
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False))
    state = tied.state_dict()
    state[HEAD] = state[EMBEDDING].clone()
    untied.load_state_dict(state)
    untied.save_pretrained(root / "untied")
    return str(root / "tied"), str(root / "untied")


def stepped(root, nproc: int, micro_batches: tuple[int, ...]) -> dict:
    tied, untied = write_models(root)
    out = root / "steps.pt"
    proc = run_cli(None, [str(out), f"{tied},{untied}", ",".join(map(str, micro_batches))], nproc=nproc, script=SCRIPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = torch.load(out, weights_only=False)
    uses_head_gradient = results.pop("uses_head_gradient")
    named = {(("tied" if model == tied else "untied"), mb, path): steps for (model, mb, path), steps in results.items()}
    return {"uses_head_gradient": uses_head_gradient, "micro_batches": micro_batches, **named}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return stepped(tmp_path_factory.mktemp("head_gradient_1"), 1, MICRO_BATCHES)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return stepped(tmp_path_factory.mktemp("head_gradient_2"), 2, TWO_RANK_MICRO_BATCHES)


def head_formula(step: dict) -> torch.Tensor:
    """fp64 d(loss / tokens)/d(W) of the step's loss inputs (every rank's micro-batches)."""
    grad = torch.zeros(step["loss_inputs"][0]["weight"].shape, dtype=torch.float64)
    for inputs in step["loss_inputs"]:
        rows = inputs["labels"] != -100
        hidden, labels, weight = inputs["hidden"][rows].double(), inputs["labels"][rows], inputs["weight"].double()
        d_logits = torch.softmax(hidden @ weight.T, dim=-1)
        d_logits[torch.arange(labels.numel()), labels] -= 1
        grad += d_logits.T @ hidden
    return grad / step["tokens"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def global_norm(grads: dict) -> float:
    return sum(float(g.double().square().sum()) for g in grads.values()) ** 0.5


def reference_grads(runs: dict, head: str, mb: int) -> dict:
    """Step 1's reference gradients (module docstring), fp64."""
    step = runs[(head, mb, "engine")][0]
    grads = {name: g.double() for name, g in runs[(head, mb, "autograd")][0]["grads"].items()}
    if head == "tied":
        grads[EMBEDDING] = head_formula(step) + runs[("untied", mb, "engine")][0]["grads"][EMBEDDING].double()
    else:
        grads[HEAD] = head_formula(step)
    return grads


def adamw_reference(masters: dict, grads: dict) -> dict:
    """One step of torch's AdamW (hpsft's groups: decay on 2-D weights) from the fp32 masters
    with `grads` clipped by their global norm as DeepSpeed clips."""
    from tests.dist_scripts.head_gradient_steps import OPTIM

    clip = min(1.0, OPTIM.grad_clip / (global_norm(grads) + 1e-6))
    params = {name: torch.nn.Parameter(w.clone()) for name, w in masters.items()}
    for name, p in params.items():
        p.grad = (grads[name] * clip).float()
    groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": OPTIM.weight_decay},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=OPTIM.lr, betas=tuple(OPTIM.betas), eps=OPTIM.eps, foreach=False).step()
    return {name: p.detach() for name, p in params.items()}


def check_first_step(runs: dict) -> dict:
    """Step 1 of every (head, micro-batches) against the references; the figures, measured all
    first so that a failure shows every one."""
    figures = {}
    for head in ("tied", "untied"):
        name = EMBEDDING if head == "tied" else HEAD
        for mb in runs["micro_batches"]:
            step = runs[(head, mb, "engine")][0]
            reference = reference_grads(runs, head, mb)
            norm = global_norm(reference)
            updated = adamw_reference(step["masters_before"], reference)
            figures[(head, mb)] = {
                "head grad": rel(step["grads"][name], reference[name]),
                "other grads": max(rel(step["grads"][k], reference[k]) for k in reference if k != name),
                "grad norm": abs(global_norm(step["grads"]) / norm - 1),
                "reported grad norm": abs(step["grad_norm"] / norm - 1),
                "weights": max(rel(step["masters"][k], updated[k]) for k in updated),
                "path before, head grad": rel(runs[(head, mb, "autograd")][0]["grads"][name], reference[name]),
            }
    return figures


def check_later_steps(runs: dict) -> dict:
    """Steps 2 (non-finite: skipped) and 3 of the untied head: the weights stay as step 1 left
    them, and step 3's head gradient is the formula's for step 3 alone."""
    figures = {}
    for mb in runs["micro_batches"]:
        first, skipped, third = runs[("untied", mb, "engine")]
        figures[mb] = {
            "skipped norm": skipped["grad_norm"],
            "weights moved by the skipped step": max(rel(skipped["masters"][k], first["masters"][k])
                                                     for k in first["masters"]),
            "step 3 head grad": rel(third["grads"][HEAD], head_formula(third)),
        }
    return figures


def assert_exact(runs: dict) -> None:
    first, later = check_first_step(runs), check_later_steps(runs)
    shown = "\n".join(f"{key}: " + ", ".join(f"{k} {v:.2e}" for k, v in values.items())
                      for key, values in [*first.items(), *later.items()])
    print("\n" + shown)
    for values in first.values():
        assert values["head grad"] < RTOL and values["other grads"] < RTOL, shown
        assert values["grad norm"] < RTOL and values["weights"] < RTOL, shown
        # DeepSpeed's fp32 norm: 5.5e-7 to 9.7e-7 off the fp64 norm of its own gradients,
        # on either path (measured).
        assert values["reported grad norm"] < 2 * RTOL, shown
    for values in later.values():
        assert values["skipped norm"] == float("inf") and values["weights moved by the skipped step"] == 0, shown
        assert values["step 3 head grad"] < RTOL, shown


def test_head_gradient_summed_into_bf16_zero1_gradient_one_process(one_process):
    """One process, 1 and 4 micro-batches, tied and untied head (module docstring)."""
    assert_exact(one_process)


@pytest.mark.slow
def test_head_gradient_summed_into_bf16_zero1_gradient_two_ranks(two_ranks):
    """2 ranks, 4 micro-batches (TWO_RANK_MICRO_BATCHES), tied and untied head: the loss's sums
    on each rank are all-reduced with the rest of the fp32 gradient."""
    assert_exact(two_ranks)


def test_only_bf16_zero1_takes_the_path(one_process):
    """bf16 ZeRO-2 (DeepSpeed's ZeRO optimizer) and fp32 keep the loss's gradient in autograd."""
    assert not any(one_process["uses_head_gradient"].values()), one_process["uses_head_gradient"]
