"""What Megatron-Core's GPTModel must be to compute a Hugging Face model exactly, or a refusal.

`architecture_of(hf_config)` reads a transformers config of a supported family into an
`Architecture`: plain numbers and flags, no Megatron import (so a refusal costs nothing and
`hpsft` runs without megatron-core). model.py turns it into a TransformerConfig and layer spec;
convert.py maps the weights. Every option the Megatron side would compute differently is
refused here by name (UnsupportedModel, a UserInputError): never trained approximately.

The families and what differs between them:
  llama    SwiGLU, RMSNorm, RoPE (default / linear / llama3 scaling), GQA, tied or not
  mistral  llama + a sliding window on every layer (when set)
  qwen2    llama + q/k/v bias, windows on the layers `layer_types` marks
  qwen3    llama + RMSNorm of each query and key head before RoPE (q_norm/k_norm)
  mixtral  mistral with a top-k routed MoE (softmax, top-k, renormalised) in every layer; the
           family's router load-balancing loss when its config turns it on (PP = 1 only)
  qwen2_moe qwen2 with a top-k MoE (softmax, top-k, renormalised iff norm_topk_prob) plus a
           shared expert scaled by sigmoid(shared_expert_gate(x)); dense MLP layers where
           `mlp_only_layers` / `decoder_sparse_step` say
"""

from dataclasses import dataclass

from hpsft.models.families import UnsupportedModel

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe")
# RoPE variants that only change the inverse frequencies (the family's own rotary embedding
# computes them, model.py loads them into Megatron's RotaryEmbedding). Dynamic NTK (depends on
# the sequence length), YaRN and LongRoPE (an attention factor, per-position tables) are refused.
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class MoE:
    num_experts: int
    top_k: int
    ffn_hidden_size: int
    # softmax over all experts, then top-k, not renormalised (Qwen2-MoE's norm_topk_prob=False);
    # else softmax over the top-k logits (= softmax, top-k, renormalised: Mixtral)
    softmax_before_top_k: bool
    shared_ffn_hidden_size: int  # 0: no shared expert
    shared_gate: bool  # the shared expert's output times sigmoid(x @ gate)
    layers: tuple[bool, ...]  # per layer: MoE (True) or a dense MLP of Architecture.ffn_hidden_size
    # > 0: the family's load-balancing loss of a row (its own function of all layers' router
    # logits together, model.router_aux_loss) times this joins the loss, as in its forward
    router_aux_loss_coef: float = 0.0


@dataclass(frozen=True)
class Architecture:
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_type: str
    rope_theta: float
    max_positions: int
    # per layer: its sliding window (key j visible from query i iff 0 <= i - j < window), or 0
    windows: tuple[int, ...]
    attention_dropout: float
    moe: MoE | None = None
    # The Hugging Face embedding's padding_idx (config.pad_token_id): that row gets no gradient
    # from the lookups of its token (nn.Embedding's rule), in every supported family.
    padding_idx: int | None = None


def refuse(config, option: str, why: str):
    raise UnsupportedModel(
        f"model type {config.model_type!r} with {option} cannot be trained exactly by engine.name=megatron: {why}. "
        "See docs/megatron.md for what is supported"
    )


def architecture_of(config) -> Architecture:
    family = config.model_type
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModel(
            f"model type {family!r} is not supported by engine.name=megatron (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}); train it with engine.name=deepspeed")
    if config.hidden_act != "silu":
        refuse(config, f"hidden_act={config.hidden_act!r}", "Megatron's gated MLP is built as SwiGLU (silu) here")
    if getattr(config, "mlp_bias", False):
        refuse(config, "mlp_bias=True", "Megatron adds MLP biases only together with the attention output's")
    if getattr(config, "attention_bias", False):
        # q/k/v and o_proj biases: Megatron's add_bias_linear would add the MLP's too
        refuse(config, "attention_bias=True", "an o_proj bias without MLP biases has no Megatron equivalent")
    if getattr(config, "pretraining_tp", 1) != 1:
        refuse(config, f"pretraining_tp={config.pretraining_tp}", "the sliced projections are not mapped")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope_type, rope_theta = rope_of(config)
    moe = moe_of(config)
    qkv_bias = family in ("qwen2", "qwen2_moe") and getattr(config, "qkv_bias", True)
    return Architecture(
        family=family, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        norm_eps=float(config.rms_norm_eps), vocab_size=config.vocab_size,
        tied_embeddings=bool(config.tie_word_embeddings), qkv_bias=bool(qkv_bias), qk_norm=family == "qwen3",
        rope_type=rope_type, rope_theta=rope_theta, max_positions=config.max_position_embeddings,
        windows=layer_windows(config), attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        moe=moe, padding_idx=config.pad_token_id,
    )


def rope_of(config) -> tuple[str, float]:
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        refuse(config, f"rope_type={rope_type!r}", f"only the RoPE types {', '.join(ROPE_TYPES)} change nothing "
               "but the inverse frequencies")
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        refuse(config, f"partial_rotary_factor={config.partial_rotary_factor}", "RoPE is applied to whole heads")
    return rope_type, float(rope["rope_theta"])


def layer_windows(config) -> tuple[int, ...]:
    """Each layer's sliding window as the family's attention applies it (0: none), one width for
    all (the config's `sliding_window`). Families with `layer_types` slide where it says
    "sliding_attention"; Mistral and Mixtral slide on every layer when `sliding_window` is set."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            refuse(config, f"layer_types {sorted(unknown)}", "only full and sliding-window attention are mapped")
        if any(kind == "sliding_attention" for kind in layer_types) and not window:
            refuse(config, "sliding layers without a sliding_window", "the window's width is unknown")
        return tuple(int(window) if kind == "sliding_attention" else 0 for kind in layer_types)
    return (int(window),) * config.num_hidden_layers


def moe_of(config) -> MoE | None:
    family = config.model_type
    if family not in ("mixtral", "qwen2_moe"):
        return None
    # The family's forward adds its router loss only with output_router_logits on (as hpsft's
    # DeepSpeed path, families.output_side).
    coef = float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else 0.0
    if getattr(config, "router_jitter_noise", 0.0):
        refuse(config, f"router_jitter_noise={config.router_jitter_noise}",
               "Megatron's input jitter is not the family's multiplicative noise on the experts' input")
    if family == "mixtral":
        return MoE(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                   ffn_hidden_size=config.intermediate_size, softmax_before_top_k=False, shared_ffn_hidden_size=0,
                   shared_gate=False, layers=(True,) * config.num_hidden_layers, router_aux_loss_coef=coef)
    # Qwen2-MoE: a layer is MoE unless listed in mlp_only_layers, every decoder_sparse_step-th.
    step, dense_only = config.decoder_sparse_step, set(config.mlp_only_layers or ())
    layers = tuple(i not in dense_only and config.num_experts > 0 and (i + 1) % step == 0
                   for i in range(config.num_hidden_layers))
    return MoE(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
               ffn_hidden_size=config.moe_intermediate_size, softmax_before_top_k=not config.norm_topk_prob,
               shared_ffn_hidden_size=config.shared_expert_intermediate_size, shared_gate=True, layers=layers,
               router_aux_loss_coef=coef)


def check_layout(arch: Architecture, tp: int, pp: int, ep: int) -> None:
    """Refuse, naming the setting, a parallel layout this model cannot be split into."""
    def need(ok: bool, what: str):
        if not ok:
            raise UnsupportedModel(f"{arch.family}: {what}")
    need(arch.num_heads % tp == 0 and arch.num_kv_heads % tp == 0,
         f"engine.tensor_parallel_size={tp} must divide the attention heads ({arch.num_heads}) and the key/value "
         f"heads ({arch.num_kv_heads})")
    need(arch.ffn_hidden_size % tp == 0, f"engine.tensor_parallel_size={tp} must divide intermediate_size "
         f"({arch.ffn_hidden_size})")
    need(arch.num_layers % pp == 0, f"engine.pipeline_parallel_size={pp} must divide the layers ({arch.num_layers})")
    if arch.moe is None:
        need(ep == 1, f"engine.expert_parallel_size={ep} needs an MoE model")
        return
    # Megatron trains MoE under TP only with its sequence parallelism, which splits each row
    # into TP equal slices: rows padded to a multiple of TP, which hpsft's rows are not.
    need(tp == 1, f"engine.tensor_parallel_size={tp} with an MoE model needs Megatron's sequence parallelism "
         "(rows padded to a multiple of TP), not supported yet: split the experts with engine.expert_parallel_size")
    # The family's router loss is one function of every layer's router logits of a row: the
    # layers of all stages together.
    need(pp == 1 or not arch.moe.router_aux_loss_coef,
         f"engine.pipeline_parallel_size={pp} with the MoE router loss (output_router_logits=True, "
         f"router_aux_loss_coef={arch.moe.router_aux_loss_coef}): the family's loss couples all stages' layers, "
         "not computed across stages; set output_router_logits=false in the model's config or use PP=1")
    need(arch.moe.num_experts % ep == 0, f"engine.expert_parallel_size={ep} must divide the experts "
         f"({arch.moe.num_experts})")
