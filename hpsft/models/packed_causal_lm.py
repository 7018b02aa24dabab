"""A causal LM run on one packed row, with the loss from the fused varlen op.

Packing: a micro-batch is one row whose `position_ids` restart at every sequence, and the
sequence boundaries (cu_seqlens) go to the attention: flash-attn's varlen kernels on GPU,
hpsft's per-sequence SDPA otherwise (varlen_attention.py). transformers' own sdpa/eager
also work (a block-diagonal mask from the position restarts, when `attention_mask=None`
and `use_cache=False`; with the cache on, packed documents silently attend to each other).
`verify_packed_attention` checks that a model really keeps sequences apart.
"""

import torch
from torch import nn

from hpsft.data.batch import target_mask
from hpsft.ops import varlen_linear_cross_entropy


class PackedCausalLM(nn.Module):
    """Wraps a HF causal LM; forward returns (sum of token losses, number of loss tokens,
    sum of token z-losses); the loss sum includes the z-loss term when its weight is set.

    The LM-head weight is read inside this module's forward, so under ZeRO-3 DeepSpeed
    gathers it as an external parameter of this module; full logits are never built.
    """

    def __init__(self, lm: nn.Module, loss_backend: str = "auto", z_loss_weight: float = 0.0,
                 label_smoothing: float = 0.0, token_accuracy: bool = False):
        super().__init__()
        self.lm = lm
        self.loss_backend = loss_backend
        self.z_loss_weight = z_loss_weight
        self.label_smoothing = label_smoothing
        self.token_accuracy = token_accuracy

    def hidden_states(self, input_ids, position_ids, offsets):
        # cu_seq_lens/max_length: the sequence boundaries for varlen attention (ours, flash-attn).
        max_length = int(offsets.diff().max()) if offsets.numel() > 1 else 0
        out = self.lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False,
            cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=max_length, max_length_k=max_length,
        )
        return out.last_hidden_state[0]

    def forward(self, input_ids, position_ids, offsets, loss_mask, per_sequence: bool = False):
        """(loss sum, loss-token count, z-loss sum, correctly predicted loss tokens or -1 when
        not measured) of the row; per sequence (loss sums and loss-token counts as (B,)
        tensors) if asked."""
        hidden = self.hidden_states(input_ids, position_ids, offsets)
        head = self.lm.get_output_embeddings()
        out = varlen_linear_cross_entropy(
            hidden, head.weight, getattr(head, "bias", None), input_ids=input_ids[0], offsets=offsets,
            loss_mask=loss_mask, reduction="none" if per_sequence else "sum", backend=self.loss_backend,
            z_loss_weight=self.z_loss_weight, label_smoothing=self.label_smoothing,
        )
        if not per_sequence:
            correct = self.count_correct(hidden, head, input_ids[0], offsets, loss_mask) if self.token_accuracy else -1
            return out.loss, out.n_tokens, out.z_loss, torch.as_tensor(correct)
        lengths = offsets.diff()
        sequence_of_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        loss_sums = out.loss.new_zeros(lengths.numel()).index_add(0, sequence_of_row, out.loss)
        targets = target_mask(loss_mask.bool(), offsets).long()
        loss_tokens = torch.zeros_like(lengths).index_add(0, sequence_of_row, targets)
        return loss_sums, loss_tokens

    @torch.no_grad()
    def count_correct(self, hidden, head, input_ids, offsets, loss_mask, chunk: int = 2048) -> int:
        """Loss tokens whose argmax prediction is right. The fused loss never forms logits, so
        this re-runs the LM head (no grad, chunked) on the loss positions: only when asked."""
        targets = torch.nonzero(target_mask(loss_mask.bool(), offsets), as_tuple=True)[0]
        correct = 0
        for start in range(0, targets.numel(), chunk):
            t = targets[start:start + chunk]
            correct += int((head(hidden[t - 1]).argmax(-1) == input_ids[t]).sum())
        return correct

    def logits(self, input_ids, position_ids, offsets):
        """Full logits of a packed row (for evaluation and checks, not for training)."""
        return self.lm.get_output_embeddings()(self.hidden_states(input_ids, position_ids, offsets))


@torch.no_grad()
def verify_packed_attention(lm: nn.Module, tolerance: float = 1e-4) -> None:
    """Run two short sequences packed and alone; refuse a model whose packed logits differ."""
    was_training = lm.training
    lm.eval()
    vocab = lm.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in (4, 3)]
    packed_ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(s.numel()) for s in seqs])[None]
    packed = lm(input_ids=packed_ids, position_ids=position_ids, use_cache=False).logits[0]
    alone = torch.cat([lm(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    lm.train(was_training)
    err = ((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-6)).item()
    if err > tolerance:
        raise RuntimeError(
            f"{type(lm).__name__} attends across packed sequences (relative logit error {err:.2e}): "
            "its attention does not honour position_ids restarts, so it cannot be trained packed"
        )
