"""A causal LM run on one packed row, with the loss from the fused varlen op.

Packing: a micro-batch is one row whose `position_ids` restart at every sequence, and the
sequence boundaries (cu_seqlens) go to the attention: flash-attn's varlen kernels on GPU,
hpsft's per-sequence attention otherwise (varlen_attention.py). transformers' own
sdpa/eager also work (a block-diagonal mask from the position restarts, when
`attention_mask=None` and `use_cache=False`; with the cache on, packed documents silently
attend to each other). What the family's own forward does after the decoder (logit
soft-capping and scaling, the MoE router loss) is redone here from `families.output_side`.
With sequence parallelism (enable_sequence_parallel) the row is one rank's slice of a
packed row (data/sequence_split.py) and attention gathers the whole row per head group
(ulysses_attention.py); the loss is this slice's share, from labels cut with the slice.
`verify_packed_training` checks the whole path against the model's own eager forward.
"""

import contextlib

import torch
from torch import nn

from hpsft.data.batch import IGNORE_INDEX, collate_jagged, longest_sequence, packed_row, shifted_labels, target_mask
from hpsft.models.families import UnsupportedModel, longest_sliding_window, output_side
from hpsft.models.ulysses_attention import INNER_IMPLEMENTATIONS, ULYSSES_IMPLEMENTATION, SequenceParallel, check_heads
from hpsft.ops import varlen_linear_cross_entropy
from hpsft.ops.vocab_parallel import sum_grad_over_tp


class PackedCausalLM(nn.Module):
    """Wraps a HF causal LM; forward returns a dict of the row's loss terms (see forward).

    The HF model's children (and any parameters or buffers of its own) are registered here
    under their own names, and the model itself is kept as a plain attribute, not a
    submodule: this module's parameter names are then exactly the HF model's
    (`model.layers.0...`, `lm_head.weight`), so DeepSpeed's checkpoints and its
    `zero_to_fp32` recover a state dict that loads into the HF model as it is.

    The LM-head weight is read inside this module's forward, so under ZeRO-3 DeepSpeed
    gathers it as an external parameter of this module; full logits are never built.
    """

    def __init__(self, lm: nn.Module, loss_backend: str = "auto", z_loss_weight: float = 0.0,
                 label_smoothing: float = 0.0, token_accuracy: bool = False):
        super().__init__()
        for name, child in lm.named_children():
            self.register_module(self.own_name(name), child)
        for name, param in lm.named_parameters(recurse=False):
            self.register_parameter(self.own_name(name), param)
        for name, buffer in lm.named_buffers(recurse=False):
            self.register_buffer(self.own_name(name), buffer, persistent=name not in lm._non_persistent_buffers_set)
        object.__setattr__(self, "lm", lm)  # not registered: its parameters are already ours, by their names
        self.loss_backend = loss_backend
        self.z_loss_weight = z_loss_weight
        self.label_smoothing = label_smoothing
        self.token_accuracy = token_accuracy
        self.output_side = output_side(lm)
        self.sequence_parallel: SequenceParallel | None = None

    def enable_sequence_parallel(self, group, size: int, rank: int, tp_size: int = 1) -> None:
        """From now on forward takes one SP rank's slice of each packed row (split_row) and
        attention runs over the group, on this rank's heads (its 1/tp_size share of them under
        tensor parallelism); call it after any check on whole rows (verify_packed_training,
        the engine's ShardingCheck), which run without the group."""
        lm = self.lm
        text_config = lm.config.get_text_config()  # a vision-language model's decoder's (else the model's own)
        check_heads(text_config, size, tp_size)
        inner = text_config._attn_implementation
        if inner not in INNER_IMPLEMENTATIONS:
            raise UnsupportedModel(
                f"engine.sequence_parallel_size={size} needs an attention that takes a packed row's exact sequence "
                f"boundaries ({' or '.join(INNER_IMPLEMENTATIONS)}, model.attn_implementation=auto picks one), "
                f"not {inner!r}")
        if self.output_side.router_aux_loss is not None:
            # The load-balancing loss is a product of per-row means over all of the row's
            # tokens: the sum of the slices' losses is not the row's.
            raise UnsupportedModel(f"{type(lm).__name__}: the MoE router loss is not computed across "
                                   "sequence-parallel slices; train it with engine.sequence_parallel_size=1")
        self.sequence_parallel = SequenceParallel(group, size, rank, inner)
        lm.get_decoder().set_attn_implementation(ULYSSES_IMPLEMENTATION)  # a vision tower keeps its own

    def own_name(self, name: str) -> str:
        if hasattr(self, name):
            raise UnsupportedModel(f"the model's submodule or parameter {name!r} clashes with an attribute of "
                                   "hpsft's PackedCausalLM")
        return name

    def train(self, mode: bool = True):
        self.lm.train(mode)  # the HF model is not a registered child: set its own flag too
        self.training = mode
        return self

    def decoder_inputs(self, input_ids, position_ids, offsets, row_input_ids=None) -> dict:
        """What the decoder takes for this row besides the sequence boundaries: the tokens and
        their positions. A vision-language model (packed_vision_lm.py) gives embeddings with its
        image features in them, and its own positions, from further model inputs. row_input_ids:
        the whole row's tokens under sequence parallelism (split_row), which a text decoder,
        seeing only its slice, does not need."""
        return {"input_ids": input_ids, "position_ids": position_ids}

    def hidden_states(self, input_ids, position_ids, offsets, max_length: int | None = None, **model_inputs):
        """The decoder's last hidden state (T, H), scaled as the family scales its logits, and
        the router logits per layer (MoE with the router loss on; else None). max_length: the
        row's longest sequence when the caller knows it on the host (packed_row); else it is
        read back from the device offsets (one wait for the device). model_inputs: what
        decoder_inputs takes besides the row (a vision-language model's pixels)."""
        # cu_seq_lens/max_length: the sequence boundaries for varlen attention (ours, flash-attn),
        # computed once per forward rather than by every layer. int32, as flash-attn's and torch's
        # varlen kernels require. Under sequence parallelism input_ids are a slice and offsets the
        # whole row's: the attention function sees the whole row (ulysses_attention.py).
        cu_seq_lens = offsets.to(torch.int32)
        if max_length is None:
            max_length = longest_sequence(offsets)
        with_router = self.output_side.router_aux_loss is not None
        out = self.lm.get_decoder()(
            **self.decoder_inputs(input_ids, position_ids, offsets, **model_inputs), use_cache=False,
            cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max_length, max_length_k=max_length,
            **({"output_router_logits": True} if with_router else {}),
            **({"sequence_parallel": self.sequence_parallel} if self.sequence_parallel else {}),
        )
        hidden = out.last_hidden_state[0]
        if self.output_side.hidden_scale != 1.0:
            hidden = hidden * self.output_side.hidden_scale
        return hidden, (out.router_logits if with_router else None)

    def router_aux_loss(self, router_logits) -> torch.Tensor:
        """The family's own load-balancing loss over this row's tokens (no padding: no mask)."""
        side = self.output_side
        return side.router_aux_loss(router_logits, side.num_experts, side.experts_per_token, None)

    @property
    def head_weight(self) -> nn.Parameter:
        """The LM head's weight (with tied embeddings, the embedding's)."""
        return self.lm.get_output_embeddings().weight

    def token_losses(self, hidden, labels, reduction, loss_grad_scale=None, head_grad_into=None):
        """The fused loss of each position against its label (shifted_labels: IGNORE_INDEX
        where a position predicts no supervised token). loss_grad_scale and head_grad_into:
        the op's grad_scale and grad_weight_into (forward)."""
        head = self.lm.get_output_embeddings()
        shard = {}
        rows = getattr(head, "vocab_rows", None)  # the vocabulary-parallel head (vocab_parallel_head.py)
        if rows is not None:
            # The op's d(hidden) is this rank's vocabulary rows' share: summed over TP in backward.
            hidden = sum_grad_over_tp(hidden, rows.group)
            shard = {"tp_group": rows.group, "vocab_start": rows.start, "vocab_size": rows.vocab_size}
        return varlen_linear_cross_entropy(
            hidden, head.weight, getattr(head, "bias", None), labels=labels, ignore_index=IGNORE_INDEX,
            reduction=reduction, backend=self.loss_backend, z_loss_weight=self.z_loss_weight,
            label_smoothing=self.label_smoothing, softcap=self.output_side.softcap, return_logprobs=True,
            grad_scale=loss_grad_scale, grad_weight_into=head_grad_into, **shard,
        )

    def forward(self, input_ids, position_ids, offsets, loss_mask=None, labels=None, slice_start: int = 0,
                per_sequence: bool = False, sequence_nll: bool = False, max_length: int | None = None,
                loss_grad_scale: float | None = None, head_grad_into: torch.Tensor | None = None,
                **model_inputs) -> dict:
        """The row's loss terms, as sums over its loss tokens:
          loss            the training objective: cross-entropy (with z-loss and label
                          smoothing when set) + router_aux_loss_coef * router_aux_loss * n_tokens
                          (the router loss of a micro-batch weighs by its share of the step's
                          loss tokens once the caller divides by that count)
          nll             the plain negative log-likelihood (detached): what train/loss reports
          n_tokens        loss tokens;  z_loss  the z-loss part (detached)
          router_aux_loss the family's load-balancing loss of this row (MoE; else 0, detached)
          correct         argmax hits on the loss tokens, or -1 when not measured
        With per_sequence (no gradients needed): {nll, n_tokens} as (B,) tensors per sequence.
        With sequence_nll (training): also sequence_nll and sequence_tokens, the same (B,)
        tensors (detached), for per-dataset losses.

        A whole packed row comes with its loss_mask; a sequence-parallel slice (split_row)
        with its labels and slice_start, its offsets being the whole row's: every term is then
        this slice's share (per sequence too), and the shares add up over the SP group.
        max_length: the longest sequence of the offsets, as packed_row/split_row give it.
        loss_grad_scale: the gradient backward will bring to `loss` (the engine's and the caller's
        scaling); with it, head_grad_into: an fp32 tensor of the head weight's shape (the
        engine's own gradient of it) into which the loss sums d(weight), already scaled, in
        this forward; autograd then gets no gradient of the head weight from the loss.
        model_inputs: the row's further inputs of decoder_inputs (none for a text model).
        """
        if labels is None:
            labels = shifted_labels(input_ids[0], loss_mask, offsets)
        hidden, router_logits = self.hidden_states(input_ids, position_ids, offsets, max_length, **model_inputs)
        out = self.token_losses(hidden, labels, "none" if per_sequence else "sum", loss_grad_scale, head_grad_into)
        if per_sequence:
            return row_terms(out, labels, offsets, slice_start, per_sequence=True)
        aux = self.router_aux_loss(router_logits) if router_logits is not None else None
        correct = self.count_correct(hidden, labels) if self.token_accuracy else -1
        return row_terms(out, labels, offsets, slice_start, sequence_nll=sequence_nll, router_aux_loss=aux,
                         router_aux_loss_coef=self.output_side.router_aux_loss_coef, correct=correct)

    @torch.no_grad()
    def count_correct(self, hidden, labels, chunk: int = 2048) -> int:
        """Loss tokens whose argmax prediction is right. The fused loss never forms logits, so
        this re-runs the LM head (no grad, chunked) on the loss positions: only when asked.
        Soft-capping is monotonic, so the argmax of the raw head output is the model's.
        The head's weight is used as a tensor, not called as a module: under ZeRO-3 a module
        call gathers the weight, and a number of calls that depends on this rank's data would
        leave the other ranks waiting in a collective."""
        head = self.lm.get_output_embeddings()
        rows = torch.nonzero(labels != IGNORE_INDEX, as_tuple=True)[0]
        correct = 0
        for start in range(0, rows.numel(), chunk):
            r = rows[start:start + chunk]
            logits = torch.nn.functional.linear(hidden[r], head.weight, getattr(head, "bias", None))
            correct += int((logits.argmax(-1) == labels[r]).sum())
        return correct

    def logits(self, input_ids, position_ids, offsets):
        """Full logits of a packed row, as the family computes them (for evaluation and
        checks, not for training)."""
        logits = self.lm.get_output_embeddings()(self.hidden_states(input_ids, position_ids, offsets)[0])
        softcap = self.output_side.softcap
        return torch.tanh(logits / softcap) * softcap if softcap else logits


def row_terms(out, labels, offsets, slice_start: int = 0, per_sequence: bool = False, sequence_nll: bool = False,
              router_aux_loss: torch.Tensor | None = None, router_aux_loss_coef: float = 0.0, correct=-1) -> dict:
    """PackedCausalLM.forward's dict of a row's loss terms from the fused op's output `out` (its
    loss and per-row log-probabilities: reduction "sum", or "none" with per_sequence), the row's
    labels and sequence boundaries; the family's router loss of the row (MoE) is added to the
    objective as router_aux_loss_coef x router_aux_loss x the row's loss tokens. Every engine's
    module returns these (the Megatron engine from its vocabulary-parallel loss)."""
    if per_sequence:
        nll, n_tokens = per_sequence_sums(out.logprobs, labels, offsets, slice_start)
        return {"nll": nll, "n_tokens": n_tokens}
    by_sequence = {}
    if sequence_nll:
        nll, n_tokens = per_sequence_sums(out.logprobs.detach(), labels, offsets, slice_start)
        by_sequence = {"sequence_nll": nll, "sequence_tokens": n_tokens}
    loss = out.loss
    aux = loss.new_zeros(())
    if router_aux_loss is not None:
        aux = router_aux_loss
        loss = loss + router_aux_loss_coef * aux * out.n_tokens
    return {"loss": loss, "nll": -out.logprobs.sum(), "n_tokens": out.n_tokens, "z_loss": out.z_loss,
            "router_aux_loss": aux.detach(), "correct": torch.as_tensor(correct), **by_sequence}


def per_sequence_sums(logprobs, labels, offsets, slice_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's NLL sum and loss-token count from the op's per-row log-probabilities
    (zero on rows without a label). The rows are positions slice_start, slice_start + 1, ...
    of the packed row whose sequence boundaries are `offsets`: a whole row, or one
    sequence-parallel slice of it (then these are the slice's shares)."""
    rows = slice_start + torch.arange(labels.numel(), device=labels.device)
    # right=True: a row at a sequence's start belongs to it (and empty sequences get none).
    sequence_of_row = torch.searchsorted(offsets, rows, right=True) - 1
    nll = logprobs.new_zeros(offsets.numel() - 1).index_add(0, sequence_of_row, -logprobs)
    supervised = (labels != IGNORE_INDEX).long()
    return nll, torch.zeros_like(offsets[1:]).index_add(0, sequence_of_row, supervised)


def eager_reference_logprobs(lm: nn.Module, sequences: list[torch.Tensor]) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1 of each sequence run alone through the model's
    own forward with transformers' eager attention, concatenated (fp64)."""
    implementation = lm.config._attn_implementation
    lm.set_attn_implementation("eager")
    try:
        if lm.config._attn_implementation != "eager":  # a self-comparison would prove nothing
            raise UnsupportedModel(f"{type(lm).__name__} cannot switch to eager attention for the start-up check")
        logprobs = []
        for ids in sequences:
            logits = lm(input_ids=ids[None], use_cache=False).logits[0].double()
            logprobs.append(logits[:-1].log_softmax(-1).gather(1, ids[1:, None])[:, 0])
        return torch.cat(logprobs)
    finally:
        lm.set_attn_implementation(implementation)


def check_row(lm: nn.Module, vocab: int | None = None, past_window: bool = True) -> tuple[list[torch.Tensor], dict]:
    """The start-up checks' input: two random sequences of fixed seed, of 24 and 9 tokens (with
    past_window, the first PAST_WINDOW tokens longer than any sliding window), and their packed
    row (fully supervised) on the device of `lm`'s weights."""
    head = lm.get_output_embeddings()
    vocab = vocab or getattr(head, "vocab_size", head.weight.shape[0])  # a vocabulary-parallel head: the whole one
    g = torch.Generator().manual_seed(0)
    window = longest_sliding_window(lm.config) if past_window else None
    lengths = (window + PAST_WINDOW if window else 24, 9)
    sequences = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    row = packed_row(collate_jagged([
        {"input_ids": ids, "loss_mask": torch.ones(len(ids), dtype=torch.bool), "index": i}
        for i, ids in enumerate(sequences)
    ]))
    device = next(lm.parameters()).device
    return sequences, {name: value.to(device) if torch.is_tensor(value) else value for name, value in row.items()}


def already_whole(params):
    return contextlib.nullcontext()


# Tokens of the check's first sequence past the longest sliding window. With the near-uniform
# attention of random weights, a dropped window of 4096 moved the log-probs by 1.8e-5 with 8
# tokens past it and by 1.5e-4 with 64 (measured on a 2-layer Mistral).
PAST_WINDOW = 64
# Largest relative log-prob error accepted, by the weights' dtype. fp32: 1.0e-6 measured on
# SmolLM2-135M (30 layers), 1.2e-7 on 2-layer models. 16-bit: the packed and the eager path
# round differently, 4.0e-3 (2 layers) and 8.8e-3 (30 layers) on SmolLM2 in bf16; a dropped
# window shows in 16-bit only where attention is sharp, as in trained models (a 2-layer
# Mistral with window 256 and q/k scaled by 16: 3.5e-2; unscaled 3.4e-3, not seen). Packed
# documents attending to each other move logits by ~0.5 (PLATFORM-NOTES.md), far above either.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@torch.no_grad()
def verify_packed_training(lm: nn.Module, gathered=already_whole) -> None:
    """Refuse a model on which hpsft's packed loss path is not the model's own computation.

    Two sequences, one PAST_WINDOW tokens longer than any sliding window, run packed through
    PackedCausalLM (hpsft's attention and output side) and each alone through the model's own
    eager forward; the log-probabilities of every next token must agree within the weights'
    dtype's TOLERANCE. This catches what a family does that hpsft does not (attention variants,
    logit transforms) by comparison with the family's own code, never with hpsft's.
    `gathered(params)`: a context in which these parameters are whole (under ZeRO-3 the engine
    gathers each module's own as it runs, but the LM-head weight is used here outside a module
    call).
    """
    implementation = lm.config._attn_implementation
    weight = next(lm.parameters())
    if implementation == "flash_attention_2" and (weight.device.type != "cuda" or weight.dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError(f"flash_attention_2 runs on CUDA in fp16/bf16, not on a {weight.dtype} model on {weight.device}: "
                         "verify the model once the engine has moved and cast it")
    was_training = lm.training
    lm.eval()
    try:
        device = next(lm.parameters()).device
        head = lm.get_output_embeddings().weight
        sequences, row = check_row(lm, vocab=getattr(head, "ds_shape", head.shape)[0])  # ZeRO-3: the whole shape
        packed = PackedCausalLM(lm)
        hidden, _ = packed.hidden_states(row["input_ids"], row["position_ids"], row["offsets"], row["max_length"])
        with gathered([head]):
            labels = shifted_labels(row["input_ids"][0], row["loss_mask"], row["offsets"])
            out = packed.token_losses(hidden, labels, "none")
        # Row t - 1 predicts target token t: the op reports log-probabilities per predicting row.
        predicting_rows = torch.nonzero(target_mask(row["loss_mask"], row["offsets"]), as_tuple=True)[0] - 1
        ours = out.logprobs[predicting_rows].double()
        reference = eager_reference_logprobs(lm, [ids.to(device) for ids in sequences])
    finally:
        lm.set_attn_implementation(implementation)
        lm.train(was_training)
    err = ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
    tolerance = TOLERANCE[weight.dtype]
    if err > tolerance:
        raise UnsupportedModel(
            f"model type {lm.config.model_type!r} ({type(lm).__name__}): hpsft's packed training path differs "
            f"from the model's own eager forward on each sequence alone (relative log-prob error {err:.2e} > "
            f"{tolerance:.0e}), e.g. its attention does not keep packed sequences apart or its forward transforms "
            "the logits in a way hpsft does not know; refused rather than trained approximately"
        )
