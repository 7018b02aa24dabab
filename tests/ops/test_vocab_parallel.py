"""The vocabulary-parallel fused loss (hpsft/ops/vocab_parallel.py) against an independent fp64
reference: the whole vocabulary's logits in fp64, a loop over sequences, plain F.cross_entropy /
log_softmax (varlen_ce_reference.py), autograd for d(hidden), d(weight), d(bias).

One torchrun launch of 4 gloo ranks (tests/dist_scripts/vocab_parallel_cases.py) runs every case
at TP=2 (two groups) and TP=4, with TRITON_INTERPRET=1 so the Triton kernels run too. Every rank's
outputs are checked: loss, z-loss, log-probs, token accuracy (argmax over the whole vocabulary)
equal to the reference and bitwise equal on every rank; d(hidden) summed by the caller's region
(sum_grad_over_tp) on every rank; each rank's d(weight) and d(bias) its slice of the reference's,
zero on padding rows. The vocabulary (37) divides by neither TP: padded as Megatron pads (to a
multiple of TP x 8 here), so at TP=4 rank 2 holds 5 real rows and rank 3 none.

Planted bugs, each seen failing the launch's tests, then reverted (72 tests then; figures: the
loss's relative error against the reference unless said otherwise):
- the sum-exp all-reduced before rescaling to the global max (s, not s * exp(m - M)): 65 failed,
  tp2 plain 0.10, tp4 all 0.068;
- the target logit summed from every rank (each rank's logit at its clamped local label, no
  owner mask): 64 failed, tp2 plain 0.80, tp4 all 1.66, tp2 shard edges 0.58;
- d(hidden) not summed over TP (sum_grad_over_tp's all-reduce dropped): 62 failed (every case
  with gradients), d(hidden) entries up to 16x (tp2) and 26x (tp4) off;
- padded rows left in (the driver multiplies every weight row): 66 failed, tp1 0.16, tp2 plain
  10.3, tp4 all 0.33 (only the unpadded cases pass);
- token accuracy without the earlier rank's tie ("a rank before the target's reaches M"
  dropped): tp2 and tp4 tied argmax fail, rows labelled with the second of two equal rows
  counted correct;
- label smoothing's uniform share over this rank's finite logits, not the group's: 45 failed,
  d(hidden) entries up to 3.6x off (tp2 smoothing), 79x (tp4 masked vocabulary);
- d(weight) summed over the chunks in bf16 (the fp32-operand design's accumulator): the two
  test_bf16_weight_gradient_is_summed_in_fp32 tests fail, 6078 of rank 0's 19456 entries (TP=2)
  and 3038 of 9728 (TP=4) beyond one bf16 rounding; the 1e-2-of-the-largest tolerance of the
  other bf16 cases passes it, hence that test.
"""

import math
import os

import pytest
import torch

from hpsft.ops import varlen_linear_cross_entropy
from test_varlen_ce import OPTIONS, assert_close
from varlen_ce_reference import IGNORE, make_batch, reduce_rows, reference_rows
from tests.conftest import REPO, run_cli

SCRIPT = str(REPO / "tests" / "dist_scripts" / "vocab_parallel_cases.py")
V, H = 37, 16
PAD_MULTIPLE = 8  # Megatron pads the vocabulary to a multiple of TP x make_vocab_size_divisible_by (128)
ALL = OPTIONS["all"]


def even_shards(tp: int, vocab: int = V, multiple: int = PAD_MULTIPLE) -> list[tuple[int, int]]:
    """(start, rows) of each rank: the vocabulary padded to a multiple of tp x multiple, split evenly."""
    rows = math.ceil(vocab / (tp * multiple)) * multiple
    return [(rank * rows, rows) for rank in range(tp)]


def with_padding(batch, padded_rows: int):
    """The weight and bias padded to padded_rows with rows that would dominate every logit if
    they took part (Megatron's padding rows are trained as ordinary rows: any values)."""
    g = torch.Generator().manual_seed(11)
    extra = padded_rows - batch.weight.shape[0]
    weight = torch.cat([batch.weight, 10 * torch.randn(extra, batch.weight.shape[1], generator=g)])
    bias = torch.cat([batch.bias, torch.full((extra,), 50.0)])
    return weight, bias


def case(name, tp, batch=None, labels=None, options=None, reduction="sum", bias=True, backend="cpp", shards=None,
         vocab=V, upstream_seed=1, **extra):
    batch = batch or make_batch()
    shards = shards or even_shards(tp, vocab)
    padded = shards[-1][0] + shards[-1][1]
    weight, full_bias = with_padding(batch, padded)
    targets = ({"labels": labels} if labels is not None
               else {"input_ids": batch.input_ids, "loss_mask": batch.loss_mask})
    total = batch.hidden.shape[0]
    gen = torch.Generator().manual_seed(upstream_seed)
    upstream = torch.randn(total, generator=gen) if reduction == "none" else torch.tensor(1.7)
    if extra.get("grad_scale"):
        upstream = torch.tensor(extra["grad_scale"])
    return {"name": f"tp{tp} {name}", "tp": tp, "hidden": batch.hidden, "weight": weight,
            "bias": full_bias if bias else None, "shards": shards, "vocab_size": vocab, "offsets": batch.offsets,
            "targets": targets, "options": options or {}, "reduction": reduction, "backend": backend,
            "upstream": upstream, "chunk_rows": extra.pop("chunk_rows", 3), **extra}


def boundary_labels(batch, shards):
    """The batch's supervised rows relabelled with the first and last real row of every shard."""
    edges = sorted({i for start, rows in shards for i in (start, min(start + rows, V) - 1) if start < V})
    labels = batch.aligned_labels()
    supervised = torch.nonzero(labels != IGNORE, as_tuple=True)[0]
    labels[supervised] = torch.tensor(edges)[torch.arange(supervised.numel()) % len(edges)]
    return labels


TIED = 3  # the first of the two equal vocabulary rows of tied_argmax_batch


def tied_argmax_batch(tp: int):
    """Integer-valued hidden states and weights (exact fp32 products), two vocabulary rows equal,
    TIED in the first shard and the first row of the last shard holding real rows: where they
    are a row's largest logit (tie_rows), torch.argmax (and the op) give the tie to the first
    index. Labels: half the rows TIED, half the other one (never an argmax hit)."""
    batch = make_batch(fully_masked=())
    g = torch.Generator().manual_seed(5)
    batch.hidden = torch.randint(-2, 3, batch.hidden.shape, generator=g).float()
    batch.hidden[:, 0] = 3.0
    batch.weight = torch.randint(-1, 2, batch.weight.shape, generator=g).float()
    first, second = TIED, max(start for start, _ in even_shards(tp) if start < V)
    for row in (first, second):  # logit 12: the largest in most rows, not all
        batch.weight[row] = 0.0
        batch.weight[row, 0] = 4.0
    labels = batch.aligned_labels()
    supervised = torch.nonzero(labels != IGNORE, as_tuple=True)[0]
    labels[supervised] = torch.where(torch.arange(supervised.numel()) % 2 == 0, first, second)
    return batch, labels


def masked_vocabulary_batch(tp: int):
    """-inf logits (through the bias) on the whole first shard and on scattered entries; no
    label a masked entry."""
    batch = make_batch()
    first_rows = even_shards(tp)[0][1]
    masked = torch.cat([torch.arange(first_rows), torch.arange(first_rows + 1, V, 5)])
    allowed = torch.ones(V, dtype=torch.bool)
    allowed[masked] = False
    batch.input_ids = allowed.nonzero().squeeze(1)[batch.input_ids % int(allowed.sum())]
    batch.bias[masked] = float("-inf")
    return batch


def bf16_batch():
    batch = make_batch(lengths=(9, 0, 4, 12, 1), hidden_size=64, vocab_size=600, fully_masked=())
    for name in ("hidden", "weight", "bias"):  # bf16 values, kept in fp32 here (the script casts)
        setattr(batch, name, getattr(batch, name).bfloat16().float())
    return batch


def cases_for(tp: int) -> list[dict]:
    cases = [case(f"{option} bias={bias}", tp, options=OPTIONS[option], bias=bias)
             for option in OPTIONS for bias in (False, True)]
    cases += [case(f"all {reduction}", tp, options=ALL, reduction=reduction) for reduction in ("none", "mean", "seq_mean")]
    cases += [
        case("all mean denominator=11", tp, options=ALL, reduction="mean", denominator=11),
        case("all grad_scale", tp, options=ALL, grad_scale=0.37),
        case("all grad_weight_into", tp, options=ALL, grad_scale=0.37, into=True),
        case("all default chunks", tp, options=ALL, chunk_rows=None),
        case("all one-row chunks", tp, options=ALL, chunk_rows=1),
        case("all torch", tp, options=ALL, backend="torch"),
        case("all none torch", tp, options=ALL, reduction="none", backend="torch"),
        case("all no_grad", tp, options=ALL, no_grad=True),
        case("all no padding", tp, batch=make_batch(vocab_size=40), options=ALL, vocab=40, shards=even_shards(tp, 40, 1)),
        case("all shard edges", tp, options=ALL, labels=boundary_labels(make_batch(), even_shards(tp))),
        case("masked vocabulary smoothing", tp, batch=masked_vocabulary_batch(tp), options={"label_smoothing": 0.1}),
        case("masked vocabulary softcap smoothing torch", tp, batch=masked_vocabulary_batch(tp),
             options={"label_smoothing": 0.1, "softcap": 3.0}, backend="torch"),
        case("tied argmax", tp, *tied_argmax_batch(tp), bias=False),
        case("bf16 fp32 gemms", tp, batch=bf16_batch(), options=ALL, vocab=600, shards=even_shards(tp, 600),
             dtype=torch.bfloat16, gemm_dtype=torch.float32, grad_scale=1.7, chunk_rows=2),
        case("bf16 16-bit gemms into fp32", tp, batch=bf16_batch(), options=ALL, vocab=600, shards=even_shards(tp, 600),
             dtype=torch.bfloat16, gemm_dtype=torch.bfloat16, grad_scale=0.37, into=True, chunk_rows=2),
    ]
    uneven = [(0, 30), (30, 10)] if tp == 2 else [(0, 5), (5, 20), (25, 1), (26, 14)]
    cases.append(case("all uneven explicit shards", tp, options=ALL, shards=uneven, explicit_starts=True))
    if TRITON:
        cases += [
            case("all triton", tp, options=ALL, backend="triton"),
            case("all none triton", tp, options=ALL, reduction="none", backend="triton"),
            case("bf16 16-bit gemms triton", tp, batch=bf16_batch(), options=ALL, vocab=600, shards=even_shards(tp, 600),
                 dtype=torch.bfloat16, gemm_dtype=torch.bfloat16, backend="triton", chunk_rows=5),
        ]
    return cases


try:
    import triton  # noqa: F401
    TRITON = True
except ImportError:
    TRITON = False

CASES = [
    case("all", 1, options=ALL), case("plain none", 1, reduction="none"),
    *cases_for(2), *cases_for(4),
]
BY_NAME = {c["name"]: c for c in CASES}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab_parallel")
    torch.save(CASES, folder / "spec.pt")
    # Cold ranks: TRITON_INTERPRET must be set before Triton decorates the kernels, which a
    # preloaded (forked) rank has imported already.
    proc = run_cli(None, [str(folder / "spec.pt"), str(folder / "out.pt")], nproc=4, script=SCRIPT,
                   env={"TRITON_INTERPRET": "1"}, timeout=900, preloaded=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(folder / "out.pt")


def reference(c):
    """fp64 loss, z-loss, per-row log-probs and argmax hits, and the gradients of
    loss x upstream w.r.t. hidden, the real weight rows and bias."""
    vocab = c["vocab_size"]
    h = c["hidden"].double().requires_grad_()
    w = c["weight"][:vocab].double().requires_grad_()
    b = c["bias"][:vocab].double().requires_grad_() if c["bias"] is not None else None
    offsets = c["offsets"]
    if "labels" in c["targets"]:
        labels = c["targets"]["labels"]
    else:
        ids, mask = c["targets"]["input_ids"], c["targets"]["loss_mask"]
        labels = torch.full_like(ids, IGNORE)
        for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            labels[start:stop - 1] = torch.where(mask[start + 1:stop].bool(), ids[start + 1:stop], IGNORE)

    def logits_of_rows(start, stop):
        logits = h[start:stop] @ w.t()
        return logits + b if b is not None else logits

    rows, zrows, logprob = reference_rows(logits_of_rows, labels, offsets, **c["options"])
    loss = reduce_rows(rows, labels, offsets, c["reduction"], c.get("denominator"))
    z_loss = reduce_rows(zrows, labels, offsets, c["reduction"], c.get("denominator"))
    with torch.no_grad():
        raw = logits_of_rows(0, h.shape[0])
        correct = (raw.argmax(dim=1) == labels) & (labels != IGNORE)
    params = [p for p in (h, w, b) if p is not None]
    grads = torch.autograd.grad(loss, params, c["upstream"].double())
    grads = dict(zip(("hidden", "weight", "bias"), grads))
    return {"loss": loss.detach(), "z_loss": z_loss, "logprobs": logprob, "correct": correct,
            "n_tokens": int((labels != IGNORE).sum()), **{f"grad_{k}": v for k, v in grads.items()}}


def shard_of(full: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of a real-vocabulary tensor, zero where they are padding."""
    out = full.new_zeros((rows, *full.shape[1:]))
    real = max(0, min(rows, full.shape[0] - start))
    out[:real] = full[start:start + real]
    return out


def gradient_rtol(c) -> float:
    # fp32: 1e-5 as the one-rank tests. bf16: the gradients come back in bf16 (2^-8) and the
    # 16-bit design rounds d(logits) to bf16 once more; the TP sum of d(hidden) adds bf16 partials.
    return 1e-2 if c.get("dtype") == torch.bfloat16 else 1e-5


def check(c, ranks: list[dict]):
    ref = reference(c)
    tp = c["tp"]
    first = ranks[0]
    for world_rank, out in enumerate(ranks):
        start, rows = c["shards"][world_rank % tp]
        assert out["n_tokens"].item() == ref["n_tokens"]
        assert_close(out["loss"], ref["loss"])
        assert_close(out["z_loss"], ref["z_loss"])
        assert_close(out["logprobs"], ref["logprobs"])
        assert torch.equal(out["correct"], ref["correct"]), (world_rank, out["correct"], ref["correct"])
        for key in ("loss", "z_loss", "logprobs", "correct"):  # the same numbers on every rank
            assert torch.equal(out[key], first[key]), (key, world_rank)
        if c.get("no_grad"):
            assert out["grad_hidden"] is None and out["grad_weight"] is None
            continue
        rtol = gradient_rtol(c)
        assert_close(out["grad_hidden"].float(), ref["grad_hidden"].float(), rtol=rtol)
        expected_weight = shard_of(ref["grad_weight"], start, rows)
        assert out["grad_weight"].shape == (rows, c["hidden"].shape[1])
        assert_close(out["grad_weight"].float(), expected_weight.float(), rtol=rtol)
        assert torch.all(out["grad_weight"][max(0, min(rows, c["vocab_size"] - start)):] == 0), "padding rows' gradient"
        if c["bias"] is not None:
            assert_close(out["grad_bias"].float(), shard_of(ref["grad_bias"], start, rows).float(), rtol=rtol)
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("name", BY_NAME)
def test_each_rank_matches_the_fp64_reference(launched, name):
    check(BY_NAME[name], launched[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CASES if c["tp"] == 1])
def test_a_group_of_one_is_the_one_rank_op(launched, name):
    """tp_group of size 1 and tp_group=None: the same numbers, bit for bit."""
    for with_group, without in zip(launched[name], launched[name + " [tp_group=None]"]):
        for key, value in with_group.items():
            assert (value is None and without[key] is None) or torch.equal(value, without[key]), key


@pytest.mark.parametrize("tp", [2, 4])
def test_the_tie_case_has_ties(tp):
    """Most supervised rows of tied_argmax_batch have the two equal rows as their largest logit."""
    batch, labels = tied_argmax_batch(tp)
    logits = batch.hidden.double() @ batch.weight.double().t()
    rows = labels != IGNORE
    ties = logits[rows, TIED] == logits[rows].max(dim=1).values
    assert int(ties.sum()) >= rows.sum() // 2, (int(ties.sum()), int(rows.sum()))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_bf16_weight_gradient_is_summed_in_fp32(launched, tp):
    """bf16 inputs, fp32-operand GEMMs, chunks of 2 rows (13 chunks), grad_scale (no rounding in
    backward): d(weight) is summed over the chunks in fp32 and rounded to bf16 once, so each
    entry is within one bf16 rounding (unit roundoff 2^-8 relative) of the fp64 reference, plus
    1e-6 of the largest entry for the fp32 sums. A bf16 accumulator rounds once per chunk:
    planted, 6078 of 19456 entries (TP=2 rank 0) beyond the bound."""
    c = BY_NAME[f"tp{tp} bf16 fp32 gemms"]
    ref = reference(c)
    for world_rank, out in enumerate(launched[c["name"]]):
        start, rows = c["shards"][world_rank % tp]
        expected = shard_of(ref["grad_weight"], start, rows)
        bound = 2**-8 * expected.abs() + 1e-6 * ref["grad_weight"].abs().max()
        excess = (out["grad_weight"].double() - expected).abs() - bound
        assert out["grad_weight"].dtype == torch.bfloat16
        assert excess.max() <= 0, f"rank {world_rank}: {int((excess > 0).sum())} entries beyond one bf16 rounding"


# In-process checks (no launch): one rank, the shard kernels' contract, the refusals.

@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("into", [False, True], ids=["returned", "grad_weight_into"])
def test_padding_rows_at_one_rank_are_never_used(backend, into):
    """TP=1 with vocab_size: the op on weight[:V] bit for bit, the padding rows' gradient zero
    (or, summed into a buffer, those rows untouched). Catches padding rows left in the block
    (planted: loss 0.16 relative off the fp64 reference in the launch's tp1 cases)."""
    c = case("padding", 1, options=ALL)
    weight, bias = c["weight"], c["bias"]

    def run(w, b, **kwargs):
        w, b, h = w.clone().requires_grad_(), b.clone().requires_grad_(), c["hidden"].clone().requires_grad_()
        buffer = torch.ones(w.shape) if into else None
        out = varlen_linear_cross_entropy(h, w, b, offsets=c["offsets"], backend=backend, chunk_rows=3, return_logprobs=True,
                                          return_correct=True, grad_scale=1.0 if into else None, grad_weight_into=buffer,
                                          **c["targets"], **ALL, **kwargs)
        out.loss.backward()
        return out, h.grad, (buffer - 1 if into else w.grad), b.grad

    padded = run(weight, bias, vocab_size=V)
    whole = run(weight[:V], bias[:V])
    for name in ("loss", "z_loss", "logprobs", "correct"):
        assert torch.equal(getattr(padded[0], name), getattr(whole[0], name)), name
    (_, grad_hidden, grad_weight, grad_bias), (_, *expected) = padded, whole
    assert torch.equal(grad_hidden, expected[0])
    assert torch.equal(grad_weight[:V], expected[1]) and torch.all(grad_weight[V:] == 0)
    assert torch.equal(grad_bias[:V], expected[2]) and torch.all(grad_bias[V:] == 0)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_token_accuracy_at_one_rank_is_the_argmax_of_the_raw_logits(backend):
    """out.correct against the fp64 logits' argmax (soft-capped: the order is the raw logits')."""
    batch, labels = tied_argmax_batch(2)
    out = varlen_linear_cross_entropy(batch.hidden, batch.weight, labels=labels, offsets=batch.offsets, backend=backend,
                                      return_correct=True, softcap=3.0)
    expected = ((batch.hidden.double() @ batch.weight.double().t()).argmax(dim=1) == labels) & (labels != IGNORE)
    assert torch.equal(out.correct, expected) and 0 < int(expected.sum()) < int((labels != IGNORE).sum())


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_shard_kernels_keep_their_contract(backend, softcap):
    """Both CPU backends' two passes (row_options.py) against the definitions in fp64, on a
    block with a fully masked row, scattered -inf entries, a ragged 2048-chunk (V = 2100), and
    labels in and outside the shard (-1)."""
    from hpsft.ops.backends import shard_kernels
    from hpsft.ops.row_options import RowOptions

    g = torch.Generator().manual_seed(0)
    block = 3 * torch.randn(5, 2100, generator=g)
    block[1] = float("-inf")
    block[2, ::3] = float("-inf")
    labels = torch.tensor([4, -1, 2098, -1, 0])
    options = RowOptions(softcap=softcap)
    kernels = shard_kernels(backend)
    capped = (softcap * torch.tanh(block.double() / softcap)) if softcap else block.double()
    row_max, sum_exp, target, shifted_sum, count = kernels.stats_(work := block.clone(), labels, options)
    finite = torch.isfinite(capped)
    expected_max = capped.amax(dim=1)
    shift = torch.where(torch.isfinite(expected_max), expected_max, 0.0)[:, None]
    assert_close(work, capped.float().nan_to_num(neginf=float("-inf")))
    assert_close(row_max[[0, 2, 3, 4]], expected_max[[0, 2, 3, 4]])
    assert row_max[1] == (float("-inf") if not softcap else -softcap)
    assert_close(sum_exp, (capped - shift).exp().sum(dim=1))
    assert_close(target, torch.where(labels >= 0, capped.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0))
    assert_close(shifted_sum, torch.where(finite, capped - shift, 0.0).sum(dim=1), rtol=1e-6)
    assert torch.equal(count, finite.sum(dim=1).float())
    lse, p_factor, uniform, coef = (torch.rand(5, generator=g) + 0.5 for _ in range(4))
    lse = lse + 10
    kernels.grad_(work, labels, lse.clone(), p_factor, uniform, coef, options)
    expected = (capped - lse.double()[:, None]).exp() * p_factor.double()[:, None] - torch.where(finite, uniform.double()[:, None], 0.0)
    owned = labels >= 0
    expected[owned.nonzero()[:, 0], labels[owned]] -= coef.double()[owned]
    if softcap:
        expected = expected * (1 - (capped / softcap) ** 2)
    assert_close(work, expected)


def test_what_the_shard_cannot_be_is_refused():
    weight = torch.zeros(8, 4)
    hidden = torch.zeros(3, 4)
    for kwargs, message in [({"vocab_start": 2}, "vocab_start applies under tensor parallelism"),
                            ({"vocab_size": 9}, r"vocab_size .* must lie in \[1, 8\]"),
                            ({"vocab_size": 0}, r"vocab_size .* must lie in \[1, 8\]")]:
        with pytest.raises(ValueError, match=message):
            varlen_linear_cross_entropy(hidden, weight, labels=torch.tensor([1, -100, 2]), **kwargs)
    with pytest.raises(ValueError, match=r"labels .* must lie in \[0, 5\)"):
        varlen_linear_cross_entropy(hidden, weight, labels=torch.tensor([1, 6, 2]), vocab_size=5)
