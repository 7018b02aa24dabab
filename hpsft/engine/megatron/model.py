"""The Megatron-Core GPTModel of this rank's pipeline stage, run on hpsft's packed rows.

Built from an `Architecture` (architecture.py) with Megatron's local layer spec (no
Transformer Engine): RMSNorm, SwiGLU as a gated fc1 = [gate; up], RoPE with the Hugging Face
model's own inverse frequencies, GQA, q/k RMSNorm for Qwen3, q/k/v bias for Qwen2, MoE with a
top-k router and SequentialMLP experts (Qwen2-MoE's gated shared expert). Core attention is
hpsft's PackedCoreAttention (attention.py).

A packed row (hpsft's jagged batch: (1, T) input_ids, offsets = cu_seqlens, the longest
sequence) runs as Megatron's THD format: `PackedSeqParams(qkv_format="thd")` with
cu_seqlens_q = cu_seqlens_kv = the offsets and max_seqlen_q = max_seqlen_kv = the longest
sequence. The THD path of Megatron's rope utils applies RoPE per sequence, each from position
0 (it takes the per-sequence route because the rotary table, max_seqlen long, is shorter than
the row unless the row holds one sequence; then the two agree), and the attention keeps the
sequences apart: no padding anywhere, no token sees another sequence.

On the last pipeline stage the forward returns the final hidden states (after the final
RMSNorm), never logits; `head_shard` gives the LM-head weight rows of this TP rank (the output
layer's, or the shared embedding's when tied) for the vocabulary-parallel fused loss.
"""

import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpsft.engine.megatron import cpu_workarounds
from hpsft.engine.megatron.architecture import Architecture, architecture_of, check_layout
from hpsft.models.families import UnsupportedModel

# The vocabulary is padded to a multiple of lcm(VOCAB_MULTIPLE, TP) rows (Megatron's
# make-vocab-size-divisible-by): the embedding and output layer split it evenly over TP, and
# the padded shape is the same for every TP size that divides 128, so checkpoints keep their
# shapes across layouts. Padded rows are zero and are never a class of the loss: see head_shard.
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def initialize_model_parallel(tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 0) -> None:
    """Megatron's parallel_state over the initialised torch.distributed world (DP = the rest),
    in Megatron's default order tp-cp-ep-dp-pp (rank = ((pp * DP + dp) * CP + cp) * TP + tp),
    and its RNG trackers."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu_workarounds.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, order="tp-cp-ep-dp-pp")
    # Without CUDA there are no CUDA RNG states to track: the inference tracker's fork() is a
    # no-op, so Megatron's own dropout would draw from torch's CPU generator (hpsft's attention
    # does its dropout itself; Megatron's hidden dropout is 0 for these families).
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())


def transformer_config(arch: Architecture, params_dtype: torch.dtype = torch.float32):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    check_layout(arch, tp, pp, ep)
    window = max(arch.windows)  # one width on every sliding layer (architecture.layer_windows)
    moe = {}
    if arch.moe is not None:
        m = arch.moe
        moe = dict(
            num_moe_experts=m.num_experts, moe_router_topk=m.top_k, moe_ffn_hidden_size=m.ffn_hidden_size,
            moe_router_pre_softmax=m.softmax_before_top_k, moe_layer_freq=[int(x) for x in m.layers],
            moe_shared_expert_intermediate_size=m.shared_ffn_hidden_size or None,
            moe_shared_expert_gate=m.shared_gate,
            # the family's load-balancing loss is not Megatron's: router_aux_loss computes it
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False, moe_permute_fusion=False,
        )
    on_cuda = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=arch.attention_dropout,
        window_size=(window - 1, 0) if window else None,
        window_attn_skip_freq=[int(w > 0) for w in arch.windows] if window else None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        sequence_parallel=False, params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        # Weights come from the Hugging Face checkpoint (convert.py): no random init.
        use_cpu_initialization=not on_cuda, perform_initialization=False,
        # Fused kernels are Transformer Engine's / Apex's / CUDA's: off.
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        # Packed rows have a different length each micro-batch: pipeline stages exchange shapes.
        # (Megatron refuses that with its default allgather MoE dispatcher, even without MoE.)
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", calculate_per_token_loss=True,
        # Batched p2p calls torch.cuda.synchronize() (cpu_workarounds.py).
        batch_p2p_comm=on_cuda,
        **moe,
    )


def layer_spec(config):
    """Megatron's local (no Transformer Engine) layer specs, one per layer of this stage, with
    hpsft's packed core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from hpsft.engine.megatron.attention import PackedCoreAttention

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in block.layer_specs:
        spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    return block


def build_model(hf_config, params_dtype: torch.dtype = torch.float32):
    """This rank's GPTModel (its pipeline stage, TP shard and EP rank's experts), weights
    uninitialised: load them with convert.load_hf_weights. parallel_state must be initialised."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    cpu_workarounds.apply()
    arch = architecture_of(hf_config)
    config = transformer_config(arch, params_dtype)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    model = GPTModel(
        config, layer_spec(config), vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_positions, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(), parallel_output=True,
        share_embeddings_and_output_weights=arch.tied_embeddings, position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    # The Hugging Face model's own inverse frequencies (its rope type's scaling included).
    model.rotary_pos_emb.inv_freq = rope_inv_freq(hf_config).to(model.rotary_pos_emb.inv_freq.device)
    model.hf_architecture = arch
    if model.pre_process and arch.padding_idx is not None:
        keep_padding_row_still(model.embedding.word_embeddings, arch.padding_idx)
    return model


def keep_padding_row_still(embedding, padding_idx: int) -> None:
    """nn.Embedding(padding_idx=...)'s rule on Megatron's vocabulary-parallel embedding: the
    lookups of the padding token add nothing to its row's gradient (their output gradient is
    dropped before it reaches the weight; a tied head still trains the row, as in the Hugging
    Face model). Without it a row the Hugging Face model keeps fixed would move."""

    def hook(module, inputs, output):
        if output.requires_grad:
            padding = (inputs[0] == padding_idx).unsqueeze(-1)
            output.register_hook(lambda grad: grad.masked_fill(padding, 0))

    embedding.register_forward_hook(hook)


def rope_inv_freq(hf_config) -> torch.Tensor:
    """RoPE's inverse frequencies as the family's own rotary embedding computes them (its rope
    type's scaling included); one that also scales the attention is refused."""
    family = hf_config.model_type
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary_class = next(cls for name, cls in vars(module).items() if name.endswith("RotaryEmbedding"))
    rotary = rotary_class(hf_config)
    if rotary.attention_scaling != 1.0:
        raise UnsupportedModel(f"model type {family!r}: its RoPE scales the attention by {rotary.attention_scaling}, "
                               "which Megatron's rotary embedding does not")
    return rotary.inv_freq.detach().float().clone()  # a plain tensor, not the nn.Buffer


def packed_seq_params(offsets: torch.Tensor, max_length: int):
    """A packed row's sequence boundaries (cu_seqlens) as Megatron's THD parameters."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = offsets.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=int(max_length), max_seqlen_kv=int(max_length))


def final_hidden_states(*, hidden_states, **_):
    """GPTModel's output_processor: the last stage returns the decoder's output after the final
    norm, [T, 1, H], instead of computing logits."""
    return hidden_states


def forward_packed_row(model, input_ids: torch.Tensor, offsets: torch.Tensor, max_length: int) -> torch.Tensor:
    """One packed row ((1, T) input_ids) through this stage: [T, 1, H], the final hidden states
    on the last stage, the activations to send on to the next one elsewhere. On a stage after
    the first the input is what the pipeline schedule set with model.set_input_tensor."""
    # position_ids feed learned position embeddings only: RoPE takes each sequence's positions
    # from the cu_seqlens (restarting at 0), so none are passed.
    return model(input_ids, None, attention_mask=None, packed_seq_params=packed_seq_params(offsets, max_length),
                 output_processor=final_hidden_states)


@dataclass
class HeadShard:
    """This TP rank's rows of the LM head, for hpsft's vocabulary-parallel fused loss
    (varlen_linear_cross_entropy(hidden, weight, tp_group=..., vocab_start=..., vocab_size=...)):
    weight row i is the logit of token vocab_start + i; rows at or past vocab_size (the real
    vocabulary) pad it to a multiple of TP and are no class of the loss (the op never multiplies
    them; they get no gradient and stay zero)."""
    weight: torch.nn.Parameter
    vocab_start: int
    vocab_size: int

    @property
    def valid_rows(self) -> int:
        return max(0, min(self.weight.shape[0], self.vocab_size - self.vocab_start))


def head_shard(model) -> HeadShard:
    """The LM-head weight shard of the last pipeline stage: the output layer's, or with tied
    embeddings the word embedding's (at PP=1 the same tensor; at PP>1 the last stage's copy,
    whose gradient Megatron's finalize_model_grads sums with the first stage's)."""
    from megatron.core import parallel_state

    if not model.post_process:
        raise ValueError("head_shard: this rank is not on the last pipeline stage")
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
        else model.output_layer.weight
    start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    return HeadShard(weight, start, model.hf_architecture.vocab_size)


class RouterLogits:
    """Records each MoE layer's router logits ([T, E], in the stage's layer order) as the
    model's forwards compute them, for the family's load-balancing loss: `take()` after a
    micro-batch's forward returns its layers' and starts afresh. It wraps the `gating` of
    this model's routers (the instances, not Megatron's class). With activation recomputation
    the recomputed forward would record again: not used together."""

    def __init__(self, model):
        self.logits = []
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.gating = self.recording(router.gating, model.config.num_moe_experts)

    def recording(self, gating, num_experts: int):
        def run(input):
            logits = gating(input)
            self.logits.append(logits.reshape(-1, num_experts))
            return logits
        return run

    def take(self) -> list:
        logits, self.logits = self.logits, []
        return logits


def router_aux_loss(arch: Architecture, router_logits: list) -> torch.Tensor:
    """The family's own load-balancing loss (transformers' load_balancing_loss_func of its
    modeling module) of one packed row: every MoE layer's router logits of the row, no padding
    (no mask). The pipeline must be one stage (architecture.check_layout)."""
    module = importlib.import_module(f"transformers.models.{arch.family}.modeling_{arch.family}")
    return module.load_balancing_loss_func(tuple(router_logits), arch.moe.num_experts, arch.moe.top_k, None)
