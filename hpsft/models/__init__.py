"""Hugging Face causal LMs run on packed rows with the varlen loss."""

from hpsft.models.loading import load_causal_lm, load_tokenizer, write_hf_folder
from hpsft.models.packed_causal_lm import PackedCausalLM, verify_packed_attention

__all__ = ["PackedCausalLM", "load_causal_lm", "load_tokenizer", "verify_packed_attention", "write_hf_folder"]
