"""The Megatron-Core engine's model layer (docs/megatron.md).

architecture.py  a Hugging Face config -> what Megatron's GPTModel must be to compute the same
                 model, or a refusal by name (imports no Megatron)
cpu_workarounds.py  the CUDA assumptions of Megatron-Core bypassed when there is no CUDA
attention.py     core attention over THD packed rows, exact per sequence
model.py         the GPTModel of this rank's pipeline stage; packed rows as THD; hidden states
                 and the LM-head shard for the fused loss
convert.py       Hugging Face <-> Megatron weights, one tensor at a time, per rank's shard

Nothing here is imported by `import hpsft`: megatron-core is an optional install, imported
only by the modules above that need it.
"""
