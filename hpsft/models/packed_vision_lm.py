"""A vision-language model (Qwen2-VL, Qwen2.5-VL, LLaVA) run on one packed row of image chats.

The packed vision micro-batch (what the data stage hands this module):
  input_ids      (1, T) the text packed row of data/batch.py: each conversation's tokens with
                 every image's placeholder ALREADY EXPANDED as the model's processor expands it
                 (Qwen2-VL: <|vision_start|>, then grid_t * grid_h * grid_w / merge_size**2
                 copies of config.image_token_id, then <|vision_end|>)
  position_ids   (1, T) restarting at 0 at every sequence (the text positions; packed_row)
  offsets        (B + 1,) the sequences' boundaries (cu_seqlens); loss_mask or labels as for
                 text: IGNORE_INDEX outside the assistant text, so image tokens are never targets
  pixel_values   float32 (total patches, patch_dim): the row's images' patches as the processor
                 gives them (Qwen2VLImageProcessor), concatenated in the order the images appear
                 in the row (the first sequence's images first, each sequence's in its order)
  image_grid_thw int64 (n_images, 3): each image's (t, h, w) patch grid, in the same order
A text-only row has pixel_values = image_grid_thw = None (or none of its sequences has images).
LLaVA (LlavaForConditionalGeneration: a vision tower, a projector, a Llama/Qwen2... decoder)
takes the images at the processor's fixed size: pixel_values float32 (n_images, C, H, W) in
row order, no image_grid_thw, each image's placeholder expanded to its fixed count of
config.image_token_id (the processor's: (H / patch) * (W / patch), + 1 with the "full"
feature strategy); its positions are the row's text positions.

What the model's own forward does to one conversation is done here to each sequence of the
row: the vision tower runs once on all of the row's images (its attention is per image, from
the grids), and the merged features fill the image placeholders in row order: each image's
features land in its own sequence, since the images are in row order. Which images belong to
which sequence follows from the placeholders counted per sequence (checked: a row whose
placeholders do not add up to its images is refused). Qwen2-VL's 3-D rotary positions (M-RoPE) are
the model's own get_rope_index run on each sequence alone with its own grids, concatenated:
they restart at every boundary, as the text positions do. The row's text positions go first
(the (4, 1, T) form transformers' Qwen2-VL text model takes for packed rows) for the
attention's boundaries; attention runs per sequence from cu_seqlens (varlen_attention.py; the
vision tower keeps its own sdpa/eager, it is not causal) and the loss is PackedCausalLM's fused
varlen cross-entropy on the assistant tokens (no logits built).

Under sequence parallelism (enable_sequence_parallel, data/sequence_split.py) each rank's row is
its slice of the packed row, with the whole row's images: every rank runs the tower on all of
them, the whole row's tokens (split_row's row_input_ids: no collective) place them, and the M-RoPE
positions are computed on the whole row and cut to the slice as the text positions are. The slice's image
tokens take their features (an image cut by the slice boundary: the part of it in the slice), so
each rank's tower gradient is that of its slice's features, summed over all ranks by the engine
as the decoder's is (DeepSpeed's data-parallel group is the whole world: engine.py).

freeze_vision=True freezes the vision tower and its projector (Qwen2-VL's `visual`, whose
merger is the projector; LLaVA's vision_tower and multi_modal_projector): no gradient reaches
them and they run without autograd. A row without images still runs the tower on a blank image,
its features added times 0 (decoder_inputs), when the tower is trained or partitioned (ZeRO-3):
every data-parallel rank then reduces the same gradients and gathers the same parameters.
"""

import torch
from torch import nn

from hpsft.models.families import UnsupportedModel
from hpsft.models.loading import has_vision_tower
from hpsft.models.packed_causal_lm import PackedCausalLM
from hpsft.models.partitioned import is_partitioned

# Vision-language classes hpsft trains exactly, and their vision tower + projector.
VISION_MODULES = {
    "Qwen2VLForConditionalGeneration": ("model.visual",),
    "Qwen2_5_VLForConditionalGeneration": ("model.visual",),
    "LlavaForConditionalGeneration": ("model.vision_tower", "model.multi_modal_projector"),
}


def is_vision_language(lm: nn.Module) -> bool:
    return has_vision_tower(lm.config)


def check_vision_supported(lm: nn.Module) -> None:
    name = type(lm).__name__
    if name not in VISION_MODULES:
        raise UnsupportedModel(
            f"model type {lm.config.model_type!r} ({name}): hpsft trains the vision-language models "
            f"{', '.join(sorted(VISION_MODULES))} exactly, not this one; refused rather than trained approximately")


def vision_modules(lm: nn.Module) -> list[nn.Module]:
    """The vision tower and projector of a supported vision-language model."""
    return [lm.get_submodule(path) for path in VISION_MODULES[type(lm).__name__]]


def images_per_sequence(image_mask: torch.Tensor, offsets: torch.Tensor, tokens_per_image: list[int]) -> list[int]:
    """How many of the row's images (in row order, each with its placeholder count) fall in each
    sequence, from the placeholders counted per sequence; refused where they do not add up."""
    placeholders = [int(image_mask[s:e].sum()) for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    counts, image = [], 0
    for sequence, wanted in enumerate(placeholders):
        first = image
        while wanted > 0 and image < len(tokens_per_image):
            wanted -= tokens_per_image[image]
            image += 1
        if wanted != 0:
            raise ValueError(
                f"packed row: sequence {sequence} has {placeholders[sequence]} image placeholder tokens, which are not "
                f"the tokens of whole images {first}.. of the row (tokens per image {tokens_per_image}); the "
                "data stage must expand each image's placeholder as the model's processor does, images in row order")
        counts.append(image - first)
    if image != len(tokens_per_image):
        raise ValueError(f"packed row: pixel_values has {len(tokens_per_image)} images, its placeholders hold "
                         f"{image}; pixel_values (and image_grid_thw) must be exactly the row's images")
    return counts


class PackedVisionLM(PackedCausalLM):
    """PackedCausalLM for a vision-language model: forward also takes the row's pixel_values and
    image_grid_thw (the module docstring's contract); its parameter names are the HF model's."""

    def __init__(self, lm: nn.Module, freeze_vision: bool = False, **loss_options):
        check_vision_supported(lm)
        super().__init__(lm, **loss_options)
        self.freeze_vision = freeze_vision
        self.mrope = hasattr(lm.model, "get_rope_index")  # Qwen2-VL's 3-D positions
        # The tower runs in every forward, a row without images on a blank image (decoder_inputs),
        # when its parameters are trained or ZeRO-3's (gathered in its forward).
        self.tower_every_row = not freeze_vision or is_partitioned(lm)
        for module in vision_modules(lm):
            module.requires_grad_(not freeze_vision)

    def whole_row(self, input_ids, row_input_ids) -> tuple[torch.Tensor, int]:
        """The whole packed row's (1, T) input_ids and where this rank's input_ids begin in it:
        under sequence parallelism split_row's row_input_ids (its slices equal, in rank order)."""
        sp = self.sequence_parallel
        if sp is None:
            return input_ids, 0
        if row_input_ids is None or row_input_ids.shape[1] != sp.size * input_ids.shape[1]:
            raise ValueError("packed row: under sequence parallelism a vision-language model takes each rank's slice "
                             "with the whole row's tokens, row_input_ids, as data/sequence_split.py's split_row gives it")
        return row_input_ids, sp.rank * input_ids.shape[1]

    def image_features(self, pixel_values, image_grid_thw) -> list[torch.Tensor]:
        """Per image, in row order, its (image tokens, H) features from the tower and projector."""
        grids = {"image_grid_thw": image_grid_thw} if self.mrope else {}
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_vision):
            return list(self.lm.model.get_image_features(pixel_values=pixel_values, return_dict=True,
                                                         **grids).pooler_output)

    def rope_positions(self, input_ids, offsets, image_mask, image_grid_thw) -> torch.Tensor:
        """(3, 1, T) the model's M-RoPE positions of each sequence alone, concatenated."""
        grids = image_grid_thw if image_grid_thw is not None else input_ids.new_zeros(0, 3)
        merge = self.lm.config.vision_config.spatial_merge_size
        counts = images_per_sequence(image_mask, offsets, (grids.prod(-1) // merge**2).tolist())
        positions, image = [], 0
        for (start, end), n in zip(zip(offsets[:-1].tolist(), offsets[1:].tolist()), counts):
            ids = input_ids[:, start:end]
            sequence_positions, _ = self.lm.model.get_rope_index(
                ids, mm_token_type_ids=image_mask[None, start:end].int(), image_grid_thw=grids[image:image + n])
            positions.append(sequence_positions)
            image += n
        return torch.cat(positions, dim=2)

    def decoder_inputs(self, input_ids, position_ids, offsets, pixel_values=None, image_grid_thw=None,
                       row_input_ids=None) -> dict:
        # Under sequence parallelism input_ids and position_ids are this rank's slice [start, stop)
        # of the row: the images are placed, and the M-RoPE positions computed, on the whole row.
        row_ids, start = self.whole_row(input_ids, row_input_ids)
        stop = start + input_ids.shape[1]
        image_mask = row_ids[0] == self.lm.config.image_token_id
        if self.mrope:
            if (pixel_values is None) != (image_grid_thw is None):
                raise ValueError("packed row: pixel_values and image_grid_thw come together (both or neither)")
            # Before the tower: it checks that each sequence's placeholders are whole images.
            rope = self.rope_positions(row_ids, offsets, image_mask, image_grid_thw)
            position_ids = torch.cat([position_ids[None], rope[:, :, start:stop]], dim=0)
        elif image_grid_thw is not None:
            raise ValueError(f"packed row: {type(self.lm).__name__} takes no image_grid_thw")
        per_image = self.image_features(pixel_values, image_grid_thw) if pixel_values is not None else []
        if not self.mrope:
            images_per_sequence(image_mask, offsets, [f.shape[0] for f in per_image])
        # Another data-parallel rank's row may have images: every rank must give every tower
        # parameter a gradient (ZeRO's gradient buckets differ between ranks otherwise: gloo aborts
        # on the size mismatch) and, under ZeRO-3, gather the tower's parameters in the same order
        # (before the embeddings, frozen or not). So a row without images runs the tower on a
        # blank image whose features are added times 0: zero gradients, the embeddings unchanged.
        blank = (self.image_features(*self.blank_image(input_ids.device)) if not per_image and self.tower_every_row
                 else [])
        embeds = self.lm.get_input_embeddings()(input_ids)
        if per_image:
            # The slice's image tokens are the row's from the `first` on: they take those features.
            first, local_mask = int(image_mask[:start].sum()), image_mask[start:stop]
            features = torch.cat(per_image)[first:first + int(local_mask.sum())]
            embeds = embeds.masked_scatter(local_mask[None, :, None], features.to(embeds.dtype))
        elif blank:
            embeds = embeds + 0 * torch.cat(blank).sum().to(embeds.dtype)  # x + 0.0 == x
        return {"inputs_embeds": embeds, "position_ids": position_ids}

    def blank_image(self, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The smallest image the tower takes, all zeros: (pixel_values, image_grid_thw). Qwen2-VL's
        is one merge_size x merge_size grid of patches (one image token); LLaVA's one image at the
        tower's size."""
        vision = self.lm.config.vision_config
        if self.mrope:
            merge = vision.spatial_merge_size
            patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
            return (torch.zeros(merge * merge, patch_dim, device=device),
                    torch.tensor([[1, merge, merge]], device=device))
        return torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size, device=device), None
