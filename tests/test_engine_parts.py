"""Engine pieces that need no process group: LR schedule, weight-decay groups, checkpointing."""

import math

import torch

from hpsft.data.batch import collate_jagged, packed_row
from hpsft.engine.optimizer import lr_lambda, param_groups
from hpsft.models import PackedCausalLM, load_causal_lm


def test_warmup_then_cosine_to_the_minimum():
    f = lr_lambda(total_steps=110, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert [round(f(s), 6) for s in range(3)] == [round(1 / 11, 6), round(2 / 11, 6), round(3 / 11, 6)]
    assert f(9) < 1.0 and f(10) == 1.0
    assert math.isclose(f(60), 0.1 + 0.9 * 0.5, rel_tol=1e-9)  # half-way through the decay
    assert math.isclose(f(110), 0.1, rel_tol=1e-9) and math.isclose(f(500), 0.1, rel_tol=1e-9)
    constant = lr_lambda(total_steps=100, warmup_steps=0, schedule="constant", min_lr_ratio=0.0)
    assert {constant(s) for s in range(100)} == {1.0}


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_gradient_checkpointing_gives_the_same_gradients(model_path):
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 49152, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.bool),
                "index": i} for i, n in enumerate([9, 4, 12])]
    row = packed_row(collate_jagged(samples))
    grads = []
    for checkpointing in (False, True):
        model = PackedCausalLM(load_causal_lm(model_path, gradient_checkpointing=checkpointing)).train()
        loss_sum = model(**row)["loss"]
        loss_sum.backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    for k, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][k], rtol=1e-5, atol=1e-7), k


def test_model_flops_count_the_head_only_where_the_loss_is_taken(model_path):
    from hpsft.utils.perf import flop_counts, model_flops

    lm = load_causal_lm(model_path)
    body, head = flop_counts(lm)
    assert lm.config.tie_word_embeddings and body + head == sum(p.numel() for p in lm.parameters())
    assert head == lm.config.vocab_size * lm.config.hidden_size
    L, H = lm.config.num_hidden_layers, lm.config.hidden_size
    every_token = model_flops(body, head, L, H, [3, 5], loss_tokens=8)
    assert every_token == 6 * (body + head) * 8 + 6 * L * H * (9 + 25)
    assert model_flops(body, head, L, H, [3, 5], loss_tokens=2) == every_token - 6 * head * 6
