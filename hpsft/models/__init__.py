"""Hugging Face causal LMs run on packed rows with the varlen loss."""

from hpsft.models.hf_export import weight_names, write_hf_folder
from hpsft.models.loading import load_causal_lm, load_tokenizer
from hpsft.models.families import UnsupportedModel, check_supported
from hpsft.models.packed_causal_lm import PackedCausalLM, verify_packed_training

__all__ = ["PackedCausalLM", "UnsupportedModel", "check_supported", "load_causal_lm", "load_tokenizer",
           "verify_packed_training", "weight_names", "write_hf_folder"]
