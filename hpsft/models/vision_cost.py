"""The vision tower's forward FLOPs per image, from a vision-language model's config: what the
rank balance (hpsft/data/balance.py) adds to a sequence for its images, in units of one token
through the decoder, so that a rank given many images is not overloaded (docs/vision.md).

FLOPs are counted as matmuls (2 per multiply-add): the patch embedding, per layer the attention
projections (8h^2 per token), attention's scores and weighted sum (4h per token per attended
token) and the MLP (4hi, gated 6hi), then the projector into the decoder. Norms, activations and
rotary embeddings are left out (elementwise, a small share). Checked against torch's own count of
the tiny towers' matmuls (tests/test_vision_cost.py).
"""

import numpy as np

from hpsft.utils.errors import UserInputError

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")


def decoder_flops_per_token(text_config) -> float:
    """Forward FLOPs of one token through the decoder's layers: attention projections (grouped
    key/value heads) and the gated MLP; attention's quadratic term is data.balance=attention's."""
    h, layers = text_config.hidden_size, text_config.num_hidden_layers
    heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
    head_dim = getattr(text_config, "head_dim", None) or h // heads
    projections = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim  # q, o; k, v
    return 2.0 * layers * (projections + 3 * h * text_config.intermediate_size)


def layer_flops(tokens: int, hidden: int, intermediate: int, gated: bool, attended: float) -> float:
    """One transformer layer over `tokens` tokens, each attending to `attended` tokens on average."""
    mlp = (6 if gated else 4) * hidden * intermediate
    return tokens * (8 * hidden * hidden + mlp + 4 * hidden * attended)


def window_sizes(merged: int, window: int) -> list[int]:
    """Qwen2.5-VL's windows along one axis of `merged` merged patches: whole windows, then the rest."""
    return [window] * (merged // window) + ([merged % window] if merged % window else [])


class VisionTowerCost:
    """`config`: a Qwen2-VL, Qwen2.5-VL or LLaVA (CLIP tower) model config."""

    def __init__(self, config):
        self.config, self.vision = config, config.vision_config
        if config.model_type not in FAMILIES:
            raise UserInputError(f"model.path: a {config.model_type} vision-language model, hpsft trains "
                                 f"{', '.join(FAMILIES)} (docs/vision.md)")
        self.decoder_token = decoder_flops_per_token(config.get_text_config())

    def image_flops(self, grid) -> float:
        """Forward FLOPs of one image through the tower and projector; `grid`: its (t, h, w) patches
        (Qwen2-VL's image_grid_thw row; ignored for LLaVA, whose images all have the tower's size)."""
        v = self.vision
        if self.config.model_type == "llava":
            patches = (v.image_size // v.patch_size) ** 2
            tokens = patches + 1  # CLIP's class token
            embed = 2 * patches * v.num_channels * v.patch_size**2 * v.hidden_size
            layers = v.num_hidden_layers * layer_flops(tokens, v.hidden_size, v.intermediate_size, False, tokens)
            feature_layers = self.config.vision_feature_layer
            features = v.hidden_size * (len(feature_layers) if isinstance(feature_layers, list) else 1)
            text_hidden = self.config.get_text_config().hidden_size
            selected = tokens if self.config.vision_feature_select_strategy == "full" else patches
            return embed + layers + 2 * selected * (features * text_hidden + text_hidden * text_hidden)
        t, gh, gw = (int(n) for n in grid)
        patches, merge = t * gh * gw, v.spatial_merge_size**2
        embed = 2 * patches * v.in_channels * v.temporal_patch_size * v.patch_size**2 * self.tower_hidden
        if self.config.model_type == "qwen2_vl":
            layers = v.depth * layer_flops(patches, v.embed_dim, v.embed_dim * v.mlp_ratio, False, patches)
            out = v.hidden_size
        else:
            window = v.window_size // v.spatial_merge_size // v.patch_size  # merged patches per window side
            side = v.spatial_merge_size
            squares = t * sum((a * b * merge) ** 2 for a in window_sizes(gh // side, window)
                              for b in window_sizes(gw // side, window))
            windowed = squares / patches  # attended patches per patch, averaged over the windows
            layers = sum(layer_flops(patches, v.hidden_size, v.intermediate_size, True,
                                     patches if i in v.fullatt_block_indexes else windowed) for i in range(v.depth))
            out = v.out_hidden_size
        merged_in = self.tower_hidden * merge
        merger = 2 * (patches // merge) * (merged_in * merged_in + merged_in * out)
        return embed + layers + merger

    @property
    def tower_hidden(self) -> int:
        return self.vision.embed_dim if self.config.model_type == "qwen2_vl" else self.vision.hidden_size

    def sequence_cost(self, grids: np.ndarray) -> float:
        """The tower's work on one sequence's images (`grids`: one row per image), in decoder tokens."""
        return sum(self.image_flops(grid) for grid in grids) / self.decoder_token
