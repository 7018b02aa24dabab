"""Vision-language models on packed rows (hpsft/models/packed_vision_lm.py) against the model's
own Hugging Face forward run on each conversation alone: tiny Qwen2-VL, Qwen2.5-VL and LLaVA
(CLIP tower, Llama decoder) models built from their config classes, the SmolLM2 tokenizer
with the image tokens added, and real photographs (scikit-image's astronaut, coffee and
chelsea) at three different sizes, processed by transformers' Qwen2VLImageProcessorPil (each
at its own size) or CLIPImageProcessorPil (all to the tower's size); placeholders expanded by
the processors' rules (Qwen2-VL: grid_t * grid_h * grid_w / merge_size**2 image tokens per
image; LLaVA: (side / patch)**2)."""

import math

import pytest
import torch

from hpsft.data.batch import collate_jagged, packed_row
from hpsft.data.sequence_split import slice_bounds
from hpsft.models.families import UnsupportedModel
from hpsft.models.packed_vision_lm import PackedVisionLM, vision_modules
from tests.conftest import REPO, TEST_MODEL, run_cli
from tests.numerics import relative_error

IMAGE_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<image>"]
LLAVA_IMAGE = 42  # the tiny LLaVA tower's image side (3 x 3 patches of 14)
# (photograph, (width, height)) per image of each conversation, its question, its answer. The
# text-only chat sits between the two image chats: positions restart after it, and the image
# order crosses it.
CONVERSATIONS = [
    ([("astronaut", (56, 56))], "What is in this picture?", "An astronaut in a white suit, smiling."),
    ([], "Say hello.", "Hello there!"),
    ([("coffee", (84, 56)), ("chelsea", (112, 84))], "Compare the two pictures.", "A cup of coffee, then a cat."),
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TEST_MODEL)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    return tok


# Qwen2.5-VL's tower: windowed attention in block 0 (windows of 2 x 2 merged patches: each
# test image spans several), full attention in block 1.
VISION_CONFIGS = {
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "hidden_size": 64},
    "qwen2_5_vl": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
                   "window_size": 56, "fullatt_block_indexes": [1]},
}


def tiny_qwen2_vl(tok, family: str = "qwen2_vl", seed: int = 0):
    """A 2-layer Qwen2-VL (or Qwen2.5-VL) with a 2-block vision tower, from its config classes."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    ids = dict(zip(IMAGE_TOKENS, tok.convert_tokens_to_ids(IMAGE_TOKENS)))
    config = AutoConfig.for_model(
        family,
        text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": None, "eos_token_id": None,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}},
        vision_config={**VISION_CONFIGS[family], "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config).float()


def image_chats(tokenizer, process, placeholder) -> list[dict]:
    """Per conversation of CONVERSATIONS: input_ids, loss_mask (its answer), and its images'
    pixel_values (and image_grid_thw), or None without images. process(PIL image): the
    processor's output for one image; placeholder(that output): its expanded placeholder text."""
    from PIL import Image
    from skimage import data

    out = []
    for images, question, answer in CONVERSATIONS:
        processed = [process(Image.fromarray(getattr(data, name)()).resize(size)) for name, size in images]
        placeholders = "".join(placeholder(p) for p in processed)
        prompt = tokenizer(f"<|im_start|>user\n{placeholders}{question}<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)["input_ids"]
        reply = tokenizer(f"{answer}<|im_end|>", add_special_tokens=False)["input_ids"]
        chat = {"input_ids": torch.tensor(prompt + reply),
                "loss_mask": torch.tensor([False] * len(prompt) + [True] * len(reply))}
        for key in ("pixel_values", "image_grid_thw"):
            chat[key] = torch.cat([p[key] for p in processed]) if processed and key in processed[0] else None
        out.append(chat)
    return out


def tiny_llava(tok, seed: int = 0, **config):
    """A 2-layer Llama decoder behind a 2-layer CLIP tower and LLaVA's projector, from its config
    classes; `config`: more LlavaConfig settings (e.g. vision_feature_select_strategy)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "bos_token_id": None, "eos_token_id": None},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": LLAVA_IMAGE, "patch_size": 14},
        image_token_id=tok.convert_tokens_to_ids("<image>"), **config)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config).float()


@pytest.fixture(scope="module")
def conversations(tokenizer):
    """Qwen2-VL's: images at their own sizes, cut into patches by Qwen2VLImageProcessorPil."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)
    out = image_chats(
        tokenizer, lambda image: processor(images=image, return_tensors="pt"),
        lambda p: "<|vision_start|>" + "<|image_pad|>" * int(p["image_grid_thw"][0].prod() // processor.merge_size**2)
        + "<|vision_end|>")
    grids = [tuple(g.tolist()) for c in out if c["image_grid_thw"] is not None for g in c["image_grid_thw"]]
    assert len(set(grids)) == 3, grids  # three different sizes
    return out


@pytest.fixture(scope="module")
def llava_conversations(tokenizer):
    """LLaVA's: each photograph resized and cropped to the tower's 42 x 42 by CLIPImageProcessorPil,
    (42 / 14)**2 = 9 <image> tokens each (the "default" strategy drops the CLS feature)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE}, crop_size=LLAVA_IMAGE)
    return image_chats(tokenizer, lambda image: processor(images=image, return_tensors="pt"),
                       lambda p: "<image>" * (LLAVA_IMAGE // 14) ** 2)


def vision_row(conversations) -> dict:
    """The packed vision micro-batch of these conversations (packed_vision_lm.py's contract)."""
    row = packed_row(collate_jagged([{"input_ids": c["input_ids"], "loss_mask": c["loss_mask"], "index": i}
                                     for i, c in enumerate(conversations)]))
    for key in ("pixel_values", "image_grid_thw"):
        if any(c[key] is not None for c in conversations):
            row[key] = torch.cat([c[key] for c in conversations if c[key] is not None])
    return row


def grad_norm(module) -> float:
    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in module.parameters() if p.grad is not None)).item()


def own_forward_loss(lm, conversations) -> tuple[float, float]:
    """The model's own forward (eager text attention) on each conversation alone: the summed
    cross-entropy of its answer tokens over all conversations' answer tokens, and the unclipped
    gradient norm of that loss."""
    lm.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    lm.zero_grad(set_to_none=True)
    total, n_tokens = 0.0, 0
    for c in conversations:
        ids = c["input_ids"]
        images = {} if c["pixel_values"] is None else {"pixel_values": c["pixel_values"]}
        if c["image_grid_thw"] is not None:
            images |= {"image_grid_thw": c["image_grid_thw"],
                       "mm_token_type_ids": (ids == lm.config.image_token_id).int()[None]}
        logits = lm(input_ids=ids[None], use_cache=False, **images).logits[0]
        targets = c["loss_mask"][1:]
        total = total + torch.nn.functional.cross_entropy(logits[:-1][targets], ids[1:][targets], reduction="sum")
        n_tokens += int(targets.sum())
    loss = total / n_tokens
    loss.backward()
    return loss.item(), grad_norm(lm)


def packed_loss(lm, row, freeze_vision: bool = False) -> tuple[float, float, PackedVisionLM]:
    lm.set_attn_implementation({"text_config": "hpsft_varlen", "vision_config": "sdpa"})
    packed = PackedVisionLM(lm, freeze_vision=freeze_vision)
    packed.zero_grad(set_to_none=True)
    out = packed(**row)
    loss = out["loss"] / out["n_tokens"]
    loss.backward()
    return loss.item(), grad_norm(packed), packed


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_packed_image_chats_equal_the_models_own_forward_per_conversation(request, tokenizer, family):
    """Three chats in one packed row (one image; text only; two images), three image sizes:
    the loss and the unclipped gradient norm equal the model's own forward per conversation
    (fp32, <= 1e-5 relative); the vision tower gets a gradient.

    Measured: Qwen2-VL loss rel 0.0, grad norm 3.1669555 vs 3.1669554 (rel 2.5e-08); Qwen2.5-VL
    (windowed vision attention) loss rel 1.8e-07, grad norm rel 2.3e-09; LLaVA loss rel 1.8e-07,
    grad norm 5.0172358 vs 5.0172362 (rel 7.1e-08).
    Planted bugs, each seen failing here:
    - an image's features given to its neighbour (the per-image features rotated by one
      image before the scatter): Qwen2-VL loss rel 3.6e-04, grad norm 3.1912 vs 3.1670
      (rel 7.6e-03); Qwen2.5-VL loss rel 6.4e-04, grad norm rel 1.8e-02; LLaVA (images of one
      size after its processor) loss rel 6.7e-04, grad norm 5.151 vs 5.017 (rel 2.7e-02).
    - (Qwen2-VL) the 3-D positions dropped (every token at its 1-D text position, images included):
      loss rel 1.1e-05, grad norm 3.16637 vs 3.16696 (rel 1.8e-04).
    Positions not restarted at a boundary: see the next test (invisible to the loss; LLaVA's
    1-D positions run 0..T-1 over the whole row: loss rel 0.0, grad norm rel 1.2e-07).
    """
    lm = tiny_llava(tokenizer) if family == "llava" else tiny_qwen2_vl(tokenizer, family)
    assert type(lm).__name__ == {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                 "llava": "LlavaForConditionalGeneration"}[family]
    conversations = request.getfixturevalue("llava_conversations" if family == "llava" else "conversations")
    ref_loss, ref_norm = own_forward_loss(lm, conversations)
    ref_trained = {name for name, p in lm.named_parameters() if p.grad is not None}
    loss, norm, packed = packed_loss(lm, vision_row(conversations))
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
    # The same parameters get gradients (LLaVA's features come from the tower's second-to-last
    # layer: its last layer gets none, in the model's own forward too), the tower and projector too.
    assert {name for name, p in packed.named_parameters() if p.grad is not None} == ref_trained
    assert all(any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters()) for m in vision_modules(lm))


def test_rope_positions_restart_at_every_packed_boundary(tokenizer, conversations):
    """The row's M-RoPE positions are each conversation's own (the model's get_rope_index on
    it alone; text-only: 0.. on all three axes, as the model's forward takes it), so they
    restart at 0 at every boundary.

    RoPE sees only position differences inside a sequence, so positions shifted by a constant
    per sequence leave the loss exact: the planted bug "positions not restarted at a packed
    boundary" (each sequence's positions + its start in the row) moved the equality test above
    by nothing (loss rel 0.0, grad norm rel 3.8e-08, rounding) and is caught here instead:
    planted, this test failed (sequence 1 starting at 31, not 0)."""
    lm = tiny_qwen2_vl(tokenizer)
    row = vision_row(conversations)
    packed = PackedVisionLM(lm)
    image_mask = row["input_ids"][0] == lm.config.image_token_id
    ours = packed.rope_positions(row["input_ids"], row["offsets"], image_mask, row["image_grid_thw"])
    own = []
    for c in conversations:
        ids = c["input_ids"]
        if c["image_grid_thw"] is None:
            own.append(torch.arange(ids.numel()).view(1, 1, -1).expand(3, 1, -1))
        else:
            types = (ids == lm.config.image_token_id).int()[None]
            grids = c["image_grid_thw"]
            own.append(lm.model.get_rope_index(ids[None], mm_token_type_ids=types, image_grid_thw=grids)[0])
    starts = row["offsets"][:-1]
    assert ours[:, 0, starts].eq(0).all(), ours[:, 0, starts]
    assert torch.equal(ours, torch.cat(own, dim=2))
    # The image tokens do carry 2-D positions (height and width differ somewhere).
    assert not torch.equal(ours[1, 0, image_mask], ours[2, 0, image_mask])


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_frozen_vision_tower_gets_no_gradient_and_stays_unchanged(request, tokenizer, family):
    """freeze_vision=True: no parameter of the vision tower or its projector (Qwen2-VL's
    `visual`, merger included; LLaVA's vision_tower and multi_modal_projector) has a gradient
    after backward, and an AdamW step with weight decay leaves them bit-identical while the
    decoder moves.

    Planted bug, seen failing for both families: freeze_vision ignored (the tower left
    trainable): the vision parameters had gradients (the first assertion failed)."""
    lm = tiny_llava(tokenizer) if family == "llava" else tiny_qwen2_vl(tokenizer)
    conversations = request.getfixturevalue("llava_conversations" if family == "llava" else "conversations")
    _, _, packed = packed_loss(lm, vision_row(conversations), freeze_vision=True)
    tower = [p for m in vision_modules(lm) for p in m.parameters()]
    assert all(p.grad is None for p in tower)
    before = [p.detach().clone() for p in tower]
    decoder_before = lm.model.language_model.layers[0].mlp.up_proj.weight.detach().clone()
    optimizer = torch.optim.AdamW([p for p in packed.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(tower, before))
    assert not torch.equal(lm.model.language_model.layers[0].mlp.up_proj.weight, decoder_before)


def test_a_row_whose_placeholders_do_not_match_its_images_is_refused(tokenizer, conversations):
    """One image left out of image_grid_thw/pixel_values: refused, naming the sequence.
    Planted bug, seen failing: the per-sequence count check skipped (get_rope_index then
    raised a bare StopIteration)."""
    lm = tiny_qwen2_vl(tokenizer)
    row = vision_row(conversations)
    row["image_grid_thw"], row["pixel_values"] = row["image_grid_thw"][:2], row["pixel_values"][:16 + 24]
    with pytest.raises(ValueError, match="sequence 2 has"):
        PackedVisionLM(lm)(**row)


def test_other_vision_language_models_are_refused_by_name():
    """Planted bug, seen failing: the class check skipped (a KeyError, not UnsupportedModel)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    config = LlavaNextConfig(
        text_config={"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        image_token_index=63)
    with pytest.raises(UnsupportedModel, match="LlavaNextForConditionalGeneration"):
        PackedVisionLM(LlavaNextForConditionalGeneration(config))


def test_the_text_path_refuses_a_vision_language_model(tokenizer):
    """check_supported (the trainer's text path) refuses a model with a vision tower by name.
    Planted bug, seen failing: the vision_config check removed (DID NOT RAISE)."""
    from hpsft.models.families import check_supported

    with pytest.raises(UnsupportedModel, match="'qwen2_vl' with a vision tower"):
        check_supported(tiny_qwen2_vl(tokenizer), "hpsft_varlen")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_a_text_only_row_gives_the_tower_zero_gradients_and_the_text_loss(request, tokenizer, family):
    """A row without images (the text-only chat alone): every tower and projector parameter that an
    image row trains gets a gradient, all zeros, not None (the blank image times 0: a data-parallel
    rank whose row has no image must reduce the same gradients as one whose row has), while the loss
    and unclipped grad norm equal the model's own forward on that chat (fp32, 1e-5 relative) and
    each other parameter's gradient is the own forward's (within 1e-5 of its norm).

    Planted bug, seen failing: the blank image removed (decoder_inputs' `elif not
    self.freeze_vision` branch dropped) -> the tower's gradients were None (the first assertion)."""
    lm = tiny_llava(tokenizer) if family == "llava" else tiny_qwen2_vl(tokenizer, family)
    image_chats_ = request.getfixturevalue("llava_conversations" if family == "llava" else "conversations")
    text_only = [c for c in image_chats_ if c["pixel_values"] is None]
    packed_loss(lm, vision_row(image_chats_))
    tower = {name for m in vision_modules(lm) for name, p in m.named_parameters(prefix=m._get_name())
             if p.grad is not None}
    ref_loss, ref_norm = own_forward_loss(lm, text_only)
    own_grads = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    row = vision_row(text_only)
    assert "pixel_values" not in row
    loss, norm, packed = packed_loss(lm, row)
    grads = {m._get_name() + "." + name: p.grad for m in vision_modules(lm) for name, p in m.named_parameters()}
    assert tower and all(grads[name] is not None and not grads[name].any() for name in tower), \
        [name for name in tower if grads[name] is None or grads[name].any()]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
    for name, grad in own_grads.items():  # each parameter's gradient within 1e-5 of its norm
        assert (dict(lm.named_parameters())[name].grad - grad).norm() <= 1e-5 * grad.norm(), name


SP_SCRIPT = str(REPO / "tests" / "dist_scripts" / "sequence_parallel_steps.py")
# The conversations in this order put the SP=2 slice boundary inside an image: Qwen2-VL's row is
# 93 tokens (94 once padded, slices of 47), the two-image chat's second image its tokens 43-54.
SP_ROW_ORDER = [0, 2, 1]


def store_sequences(conversations) -> list[dict]:
    """The conversations as the token store gives them: a sequence without images has empty ones."""
    empty = {key: next(c[key] for c in conversations if c[key] is not None)[:0]
             for key in ("pixel_values", "image_grid_thw") if any(c[key] is not None for c in conversations)}
    return [{"input_ids": c["input_ids"], "loss_mask": c["loss_mask"],
             **{key: none if c[key] is None else c[key] for key, none in empty.items()}} for c in conversations]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_sp2_image_rows_equal_one_process_and_the_models_own_forward(request, tmp_path, tokenizer, family):
    """DP=1 x SP=2 under ZeRO-2 (2 gloo ranks, hpsft's DeepSpeed engine, the SP steps script) on one
    packed row of three chats (one image; two images; text only) whose slice boundary cuts an image
    in two: the step's loss, unclipped gradient norm and gradients (all, and the vision tower's and
    projector's alone: each rank's come from its slice's features, summed over the ranks by the
    engine) equal the model's own forward per conversation and one process's packed row (fp32,
    <= 1e-5 relative). A second step, whose rank-1 slice has no image token, runs.
    Measured: Qwen2-VL loss 10.82866160 vs 10.82866192 (rel 2.9e-08), grad norm 3.55411923 vs
    3.55411918 (1.4e-08), grads 5.1e-07, tower grads 4.6e-07; Qwen2.5-VL (windowed tower attention)
    loss rel 8.8e-08, grad norm 3.20075976 vs 3.20075940 (1.1e-07), grads 5.9e-07, tower grads
    8.3e-07; LLaVA loss rel 1.2e-07, grad norm 5.01723568 vs 5.01723622 (1.1e-07), grads 6.8e-07.
    Planted (Qwen2-VL), each seen failing:
    - the slice's features not offset by its first image token: loss rel 3.5e-04, grad norm 6.9e-04;
    - rank 1 given rank 0's M-RoPE positions: loss rel 1.3e-05, grad norm 1.6e-04;
    - rank 1's tower gradient dropped (features.detach() + 0 * features): loss rel 2.9e-08, unseen
      by the loss, grad norm 6.1e-02;
    - the scatter skipped on a slice without image tokens (no tower graph there): step 2 aborted in
      ZeRO-2's gradient all_reduce (rank 1 exit -6);
    - every rank given rank 0's ids as the whole row (split_row's row_input_ids = rank 0's slice
      repeated): ValueError "sequence 1 has 14 image placeholder tokens, which are not the tokens of
      whole images 1.. of the row" on both ranks.
    Planted (Qwen2.5-VL): rank 1 given rank 0's M-RoPE positions: loss rel 3.0e-06 and grad norm
    1.5e-06 (both within 1e-5: unseen), grads 5.2e-03 and tower grads 6.5e-03 (failed)."""
    lm = tiny_llava(tokenizer) if family == "llava" else tiny_qwen2_vl(tokenizer, family)
    chats = request.getfixturevalue("llava_conversations" if family == "llava" else "conversations")
    conversations = [chats[i] for i in SP_ROW_ORDER]
    row = vision_row(conversations)
    image_tokens = row["input_ids"][0] == lm.config.image_token_id
    boundary = slice_bounds(image_tokens.numel(), 1, 2)[0]
    assert image_tokens[boundary - 1] and image_tokens[boundary], "no image cut by the slice boundary"
    lm.save_pretrained(tmp_path / "model")
    # Step 2's row (the one-image chat and the text-only one) has no image token in rank 1's slice:
    # its tower must still get a (zero) gradient there, or ZeRO's gradient reduction differs by rank.
    text_end = vision_row(conversations[::2])["input_ids"][0]
    assert not (text_end[slice_bounds(text_end.numel(), 1, 2)[0]:] == lm.config.image_token_id).any()
    spec = {"sequences": store_sequences(conversations), "steps": [[[0, 1, 2]], [[0, 2]]],
            "layouts": [{"name": "zero2 sp2", "model": str(tmp_path / "model"), "zero_stage": 2, "sp": 2}]}
    torch.save(spec, tmp_path / "spec.pt")
    proc = run_cli(None, [str(tmp_path / "spec.pt"), str(tmp_path / "out.pt")], nproc=2, script=SP_SCRIPT,
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    run = torch.load(tmp_path / "out.pt")["zero2 sp2"]
    assert len(run["losses"]) == 2 and all(math.isfinite(loss) for loss in run["losses"]), run["losses"]
    ref_loss, ref_norm = own_forward_loss(lm, conversations)
    ref_grads = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    one_loss, one_norm, _ = packed_loss(lm, row)
    grads = run["grads"]
    # Parameters the model's own forward leaves without a gradient (LLaVA's last tower layer) get zeros.
    assert all(not grads[name].any() for name in set(grads) - set(ref_grads))
    grads = {name: grads[name] for name in ref_grads}
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item()
    tower = {name for name, p in lm.named_parameters() if any(p is q for m in vision_modules(lm) for q in m.parameters())}
    figures = {"loss vs own forward": abs(run["losses"][0] - ref_loss) / ref_loss,
               "loss vs one process": abs(run["losses"][0] - one_loss) / one_loss,
               "grad norm vs own forward": abs(norm - ref_norm) / ref_norm,
               "grad norm vs one process": abs(norm - one_norm) / one_norm,
               "grads vs own forward": relative_error(grads, ref_grads),
               "tower grads vs own forward": relative_error({n: grads[n] for n in tower & set(grads)},
                                                            {n: ref_grads[n] for n in tower & set(grads)})}
    shown = f"loss {run['losses'][0]:.8f} (own {ref_loss:.8f}), grad norm {norm:.8f} (own {ref_norm:.8f}); " + \
        "; ".join(f"{name} {value:.1e}" for name, value in figures.items())
    print(shown)
    assert all(value <= 1e-5 for value in figures.values()), shown


def as_bf16(lm):
    """lm's parameters in bf16, its buffers (rotary frequencies) kept fp32: what DeepSpeed's
    engine.dtype=bfloat16 casts (docs/precision.md); pixel_values stay fp32 as the store gives them."""
    for p in lm.parameters():
        p.data = p.data.to(torch.bfloat16)
    return lm


# bf16 against the fp32 model's own forward, the bounds test_precision.py sets for text (loss
# 5e-3, gradient 1e-2: bf16 rounding of a 2-layer model, measured there 1.0e-5 / 5.8e-3).
BF16_LOSS, BF16_GRAD = 5e-3, 1e-2


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_bf16_image_rows_train_the_fp32_models_function(request, tokenizer, family):
    """A packed row of the image chats, and the text-only chat alone (the blank image), run in bf16
    (bf16 weights, fp32 buffers and pixel_values) against the fp32 model's own forward per
    conversation: loss, unclipped grad norm and gradients (all, and the tower's and projector's)
    within bf16's bounds (BF16_LOSS, BF16_GRAD); the bf16 run's gradients are bf16, the blank
    image's tower gradients exactly zero. Measured and planted: docs/precision.md."""
    make = tiny_llava if family == "llava" else tiny_qwen2_vl
    chats = request.getfixturevalue("llava_conversations" if family == "llava" else "conversations")
    fp32 = make(tokenizer)
    bf16 = as_bf16(make(tokenizer))
    tower = {name for name, p in fp32.named_parameters()
             if any(p is q for m in vision_modules(fp32) for q in m.parameters())}
    image_row_trained, figures = set(), {}
    for rows, conversations in (("image row", chats), ("text row", [c for c in chats if c["pixel_values"] is None])):
        ref_loss, ref_norm = own_forward_loss(fp32, conversations)
        ref_grads = {name: p.grad for name, p in fp32.named_parameters() if p.grad is not None}
        loss, norm, _ = packed_loss(bf16, vision_row(conversations))
        grads = {name: p.grad for name, p in bf16.named_parameters() if p.grad is not None}
        assert all(g.dtype == torch.bfloat16 for g in grads.values())
        figures[f"{rows} loss"] = abs(loss - ref_loss) / ref_loss
        figures[f"{rows} grad norm"] = abs(norm - ref_norm) / ref_norm
        figures[f"{rows} grads"] = relative_error({n: grads[n] for n in ref_grads}, ref_grads)
        if rows == "image row":
            image_row_trained = tower & set(ref_grads)
            figures[f"{rows} tower grads"] = relative_error({n: grads[n] for n in image_row_trained},
                                                            {n: ref_grads[n] for n in image_row_trained})
        else:  # the blank image: every tower gradient the image row gave is there, all zeros
            assert image_row_trained <= set(grads) and not any(grads[n].any() for n in image_row_trained)
    shown = "; ".join(f"{name} {value:.1e}" for name, value in figures.items())
    print(f"\n{family} bf16 vs fp32: {shown}")
    assert all(value <= (BF16_LOSS if name.endswith("loss") else BF16_GRAD) for name, value in figures.items()), shown
