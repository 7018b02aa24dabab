"""Varlen (packed-sequence) cross-entropy ops working on nested-tensor offsets."""

from hpsft.ops.varlen_cross_entropy import VarlenCEOutput, varlen_cross_entropy, varlen_linear_cross_entropy

__all__ = ["VarlenCEOutput", "varlen_cross_entropy", "varlen_linear_cross_entropy"]
