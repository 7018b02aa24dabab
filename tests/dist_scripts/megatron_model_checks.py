"""Megatron-Core's GPTModel (hpsft/engine/megatron) against the Hugging Face model's own eager
forward, at every parallel layout this world holds, in one launch.

    torchrun --nproc_per_node N tests/dist_scripts/megatron_model_checks.py OUT_JSON FAMILY:TP,PP,EP ...
    python tests/dist_scripts/megatron_model_checks.py OUT_JSON FAMILY:1,1,1 ...  (one process)

For each FAMILY (a tiny random model of tests/megatron_models.py) and layout: parallel_state is
initialised for TP x PP x EP (DP = the rest), the GPTModel built and loaded from the Hugging
Face model's save_pretrained folder (convert.hf_folder_tensor, load_hf_weights), wrapped in Megatron's
DistributedDataParallel, and Megatron's own schedule (get_forward_backward_func: 1F1B under
PP) runs the packed rows (data-parallel rank d takes rows d, d + DP, ...) with hpsft's
vocabulary-parallel fused loss on the final hidden states and this TP rank's LM-head shard,
summed over the loss tokens, divided by the step's loss-token count
(Megatron's calculate_per_token_loss and finalize_model_grads); then one step of Megatron's
distributed optimizer. Rank 0 gathers the weights (round trip), the gradients and the stepped
weights back to Hugging Face names (convert.gathered_hf_tensors) and compares them with the
Hugging Face model run on each sequence alone and torch's AdamW. OUT_JSON gets, per
"FAMILY:TP,PP,EP": the loss and the reference's, the worst gradient error and its tensor, the
unclipped gradient norm and the reference's, the worst stepped weight, the round trip's
mismatching tensors, the LM-head shards' (tp_rank, vocab_start, valid_rows, padding is zero).
"""

import json
import os
import shutil
import sys
import tempfile
import warnings
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.megatron_models import PACKED_ROWS, hf_reference, tiny_config  # noqa: E402
from tests.numerics import relative_error  # noqa: E402

from hpsft.data.batch import IGNORE_INDEX, collate_jagged, packed_row, shifted_labels  # noqa: E402
from hpsft.engine.megatron import convert  # noqa: E402
from hpsft.engine.megatron import model as mmodel  # noqa: E402
from hpsft.ops import varlen_linear_cross_entropy  # noqa: E402
from hpsft.ops.vocab_parallel import sum_grad_over_tp  # noqa: E402

warnings.filterwarnings("ignore")


def loss_of_hidden(model, labels, n_tokens: int, router_logits, hidden):
    """hpsft's vocabulary-parallel fused loss on the final hidden states and this TP rank's
    LM-head shard (the padded rows excluded), summed over the row's loss tokens; with the MoE
    router loss on, + its coefficient x the row's router loss x the row's loss tokens (hpsft's
    weighting: the step's loss divides by its loss tokens)."""
    from megatron.core import parallel_state as ps

    head = mmodel.head_shard(model.module)
    tp_group = ps.get_tensor_model_parallel_group()
    # The op's d(hidden) is this rank's part (its vocabulary rows): summed over TP in backward.
    out = varlen_linear_cross_entropy(sum_grad_over_tp(hidden[:, 0], tp_group), head.weight, labels=labels,
                                      reduction="sum", tp_group=tp_group, vocab_start=head.vocab_start,
                                      vocab_size=head.vocab_size)
    loss = out.loss
    if router_logits is not None:
        arch = model.module.hf_architecture
        loss = loss + arch.moe.router_aux_loss_coef * mmodel.router_aux_loss(arch, router_logits.take()) * n_tokens
    return loss, torch.tensor(n_tokens, dtype=torch.int), {"loss": loss.detach()}


def run_layout(family: str, tp: int, pp: int, ep: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    mmodel.initialize_model_parallel(tp, pp, ep)
    config = tiny_config(family)
    reference, samples = hf_reference(family)  # the same weights and rows on every rank
    weights = reference.state_dict()

    folder = [tempfile.mkdtemp(prefix=f"{family}-") if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        reference.save_pretrained(folder[0])  # MoE experts in the checkpoint's per-expert layout
    dist.broadcast_object_list(folder)

    model = mmodel.build_model(config)
    convert.load_hf_weights(model, convert.hf_folder_tensor(folder[0], model.hf_architecture))
    dist.barrier()  # every rank has read its tensors
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
    moe = model.hf_architecture.moe
    router_logits = mmodel.RouterLogits(model) if moe is not None and moe.router_aux_loss_coef else None
    round_trip = [name for name, whole in convert.gathered_hf_tensors(model)
                  if dist.get_rank() == 0 and not torch.equal(whole, weights[name])]

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = [packed_row(collate_jagged([samples[i] for i in row])) for row in PACKED_ROWS[dp_rank::dp]]
    for row in rows:
        row["labels"] = shifted_labels(row["input_ids"][0], row["loss_mask"], row["offsets"])
    n_tokens = int(sum((s["loss_mask"][1:]).sum() for s in samples))  # the step's loss tokens, all ranks

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=0.9, adam_beta2=0.95, adam_eps=ADAM_EPS,
        clip_grad=CLIP, use_distributed_optimizer=True), [ddp])
    # Megatron's LR scheduler (OptimizerParamScheduler) sets each group's decay from its
    # wd_mult (0 on 1-D parameters); without one, a group keeps the base weight_decay: set here.
    for group in optimizer.param_groups:
        group["weight_decay"] = WEIGHT_DECAY * group["wd_mult"]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()

    def forward_step(data_iterator, module):
        row = next(data_iterator)
        hidden = mmodel.forward_packed_row(module, row["input_ids"], row["offsets"], row["max_length"])
        return hidden, partial(loss_of_hidden, ddp, row["labels"], int((row["labels"] != IGNORE_INDEX).sum()),
                               router_logits)

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(rows), model=[ddp], num_microbatches=len(rows),
        seq_length=max(r["input_ids"].shape[1] for r in rows), micro_batch_size=1, forward_only=False,
        # every DP rank gets the whole reduced gradient, to be compared (the distributed optimizer
        # reads its own shard of it either way)
        force_all_reduce=True)
    # The step's loss: the micro-batches' loss sums on each replica's last stage (one TP rank),
    # summed over the replicas, over the step's loss tokens (finalize_model_grads divided the
    # gradients by the same count, all-reduced over DP).
    loss_sum = torch.zeros((), dtype=torch.float64)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        loss_sum += sum(float(o["loss"]) for o in outputs)
    dist.all_reduce(loss_sum)

    grads = {name: whole for name, whole in convert.gathered_hf_tensors(model, lambda n, p: p.main_grad)}
    # One step of Megatron's distributed optimizer (Adam, fp32 master weights sharded over DP,
    # the gradient clipped by its global norm), then the weights gathered.
    _, grad_norm, _ = optimizer.step()
    stepped = dict(convert.gathered_hf_tensors(model))
    head = mmodel.head_shard(model) if model.post_process else None
    heads = [None] * dist.get_world_size()
    dist.all_gather_object(heads, (ps.get_tensor_model_parallel_rank(), head.vocab_start, head.valid_rows,
                                   bool(head.weight[head.valid_rows:].abs().sum() == 0)) if head else None)
    if dist.get_rank() != 0:
        return {}
    ref_loss = reference_loss_and_grads(reference, samples, n_tokens, router_logits is not None)
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    errors = {name: relative_error(grads[name], ref_grads[name]) for name in grads}
    worst = max(errors, key=errors.get)
    ref_norm = reference_step(reference)
    weight_errors = {name: relative_error(stepped[name], p.detach()) for name, p in reference.named_parameters()}
    worst_weight = max(weight_errors, key=weight_errors.get)
    return {"grad_norm": grad_norm, "reference_grad_norm": ref_norm, "worst_weight": worst_weight,
            "worst_weight_error": weight_errors[worst_weight],"loss": float(loss_sum) / n_tokens, "reference_loss": float(ref_loss), "worst_grad": worst,
            "worst_grad_error": errors[worst], "grads_compared": len(errors), "round_trip_mismatches": round_trip,
            "head_shards": sorted({h for h in heads if h is not None})}


def reference_loss_and_grads(reference, samples, n_tokens: int, router_loss: bool) -> torch.Tensor:
    """The Hugging Face model's own forward on each sequence alone (eager attention), its mean
    loss times its loss tokens, over the step's loss tokens; with the router loss, + for each
    packed row the coefficient x HF's router loss of the row's sequences as one right-padded
    batch with its attention mask (the row's tokens, no padding) x the row's loss tokens, over
    the step's loss tokens. Backward into reference's .grad."""
    reference.zero_grad()
    loss = sum(
        reference(input_ids=s["input_ids"][None], labels=torch.where(s["loss_mask"], s["input_ids"], -100)[None],
                  use_cache=False, output_router_logits=False).loss * int(s["loss_mask"][1:].sum())
        for s in samples) / n_tokens
    if router_loss:
        for row in PACKED_ROWS:
            seqs = [samples[i] for i in row]
            width = max(len(s["input_ids"]) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, :len(s["input_ids"])], mask[r, :len(s["input_ids"])] = s["input_ids"], 1
            aux = reference(input_ids=ids, attention_mask=mask, use_cache=False, output_router_logits=True).aux_loss
            row_tokens = sum(int(s["loss_mask"][1:].sum()) for s in seqs)
            loss = loss + reference.config.router_aux_loss_coef * aux * row_tokens / n_tokens
    loss.backward()
    return loss.detach()


LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 1.0
# Adam's first update is lr * g / (|g| + eps): with eps = 1e-8 an element whose gradient is ~1e-9
# (a near-cancellation, 30 % apart between two fp32 summation orders) moves by a different
# fraction of lr (seen: 2.4e-4 apart, 1e-4 of its tensor). With eps = 1e-3 a gradient's rounding
# (~1e-8) moves the update by at most lr / eps x 1e-8 = 1e-7, and the clipping coefficient still
# shows (the gradients are 1e-4..1e-2).
ADAM_EPS = 1e-3


def reference_step(reference) -> float:
    """torch's AdamW on the reference's gradients, clipped by their global norm to CLIP, with no
    weight decay on 1-D parameters (Megatron's rule, and hpsft's): the unclipped norm."""
    params = list(reference.parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(params, CLIP))
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=ADAM_EPS).step()
    return norm


def main(out: str, cases: list[str]) -> None:
    if "RANK" not in os.environ:  # one plain process (run_cli with nproc=1): a world of one
        from hpsft.utils.distributed import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo")
    results = {}
    for case in cases:
        family, layout = case.split(":")
        tp, pp, ep = (int(x) for x in layout.split(","))
        results[case] = run_layout(family, tp, pp, ep)
        if dist.get_rank() == 0:
            print(case, json.dumps(results[case]), flush=True)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
