"""Megatron core attention over a THD packed row, exact per sequence.

Megatron-Core's local DotProductAttention takes no packed sequences (it asserts
packed_seq_params is None; THD is Transformer Engine's), so the layer spec gets this module
instead. It runs hpsft's own varlen attention (hpsft/models/varlen_attention.py, the one the
DeepSpeed path runs): torch's varlen flash kernel on a GPU in 16-bit, each sequence's own
causal attention otherwise. Sequence boundaries come from PackedSeqParams.cu_seqlens_q, so no
token attends across a sequence boundary; a layer's sliding window is Megatron's own
`window_size` = (window - 1, 0) on the layers `window_attn_skip_freq` marks (architecture.py
reads both from the Hugging Face config).

Query/key/value arrive as Megatron's THD tensors [tokens, heads, head_dim] (this TP rank's
heads, the key/value heads of its query groups); the output is [tokens, heads * head_dim].
"""

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from hpsft.models.varlen_attention import varlen_attention


class PackedCoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedCoreAttention runs without context parallelism (context_parallel_size=1)")
        self.is_causal = True  # varlen_attention refuses a module that is not
        self.scaling = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # layer_number is 1-based over the whole model (this stage's offset included)
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.sliding_window = config.window_size[0] + 1 if windowed else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedCoreAttention takes packed rows only: pass PackedSeqParams(qkv_format='thd')")
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention takes no attention bias")
        # [T, heads, D] -> (1, heads, T, D), as transformers' attention functions take them
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
        out, _ = varlen_attention(self, q, k, v, None, scaling=self.scaling, dropout=self.dropout,
                                  sliding_window=self.sliding_window,
                                  cu_seq_lens_q=packed_seq_params.cu_seqlens_q,
                                  max_length_q=packed_seq_params.max_seqlen_q)
        return out[0].reshape(out.shape[1], -1)  # (1, T, heads, D) -> [T, heads * D]
