"""Image chat rows: the images of a row found, resolved and decoded, and the text each becomes.

Two row shapes carry images:
- OpenAI-style messages whose content is a list of parts: `{"type": "text", "text": ...}`,
  `{"type": "image", "image": path}` or `{"type": "image_url", "image_url": {"url": path} | path}`
  with a local path (a `file://` prefix is allowed); http(s) and data URLs are refused (no fetching);
- ShareGPT/LLaVA-style rows whose text holds `<image>` placeholders, one per entry of the row's
  `images` column (a list of paths), in order.
Relative paths are resolved against the folder of the data file, never the working directory.
Each image becomes IMAGE_MARK in its message's text; expanded_messages replaces every mark by the
model's placeholder tokens, as many as the processor gives for that image. Two layouts
(image_layout):
- Qwen2-VL (its Qwen2VLImageProcessor, the default): each image cut into patches, pixel_values
  [patches, patch_dim] and image_grid_thw [1, 3] per image; placeholder `<|vision_start|>` +
  grid_t*grid_h*grid_w / merge_size**2 x `<|image_pad|>` + `<|vision_end|>`;
- LLaVA (LlavaImages: a CLIP image processor and the model's tower settings): each image resized
  and cropped to the tower's size, pixel_values [1, C, H, W] per image, no grid; placeholder
  `<image>` x (H // patch) * (W // patch) (+ 1 with the "full" vision_feature_select_strategy,
  whose features keep CLIP's CLS), LlavaProcessor's count.
"""

from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from hpsft.data.chat_messages import IMAGE_MARK, BadRow, flatten_parts
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


def image_messages(messages, images, data_file: Path) -> tuple[list[dict], list[Path]]:
    """The messages with string contents (each image part an IMAGE_MARK) and the row's image
    paths in the order they appear. `images` is the row's `images` column (None when it has none)."""
    if images is None:
        images = []
    if not isinstance(images, (list, tuple)) or not all(isinstance(p, str) for p in images):
        raise BadRow(f"the images column must be a list of paths, got {images!r:.80}")
    out, paths = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, (list, tuple)):
            text, image_parts = flatten_parts(i, content)
            msg = {**msg, "content": text}
            paths += [part_path(f"message {i} part {j}", part, part["type"]) for j, part in image_parts]
        out.append(msg)
    if paths and images:
        raise BadRow("the row has both image content parts and an images column: give its images one way")
    if images:
        marks = sum(m["content"].count(IMAGE_MARK) for m in out if isinstance(m.get("content"), str))
        if marks != len(images):
            raise BadRow(f"the row's text has {marks} {IMAGE_MARK} placeholders but its images column lists "
                         f"{len(images)} images: put one {IMAGE_MARK} in the text where each image goes")
        paths = list(images)
    for i, msg in enumerate(out):
        # An image's tokens would land in that turn: in an assistant turn, inside the loss mask.
        if paths and msg.get("role") != "user" and IMAGE_MARK in str(msg.get("content")):
            raise BadRow(f"message {i} ({msg.get('role')}) holds an image: images go in user turns only")
    return out, [resolve_image(path, data_file) for path in paths]


def part_path(where: str, part: dict, kind: str) -> str:
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise BadRow(f"{where} ({kind}) must give the image's path as a string, got {value!r:.80}")
    if value.startswith(("http://", "https://", "data:")):
        raise BadRow(f"{where} ({kind}) is a URL ({value:.60}): images are not fetched; download it and give "
                     "its local path")
    return value.removeprefix("file://")


def resolve_image(path: str, data_file: Path) -> Path:
    resolved = Path(data_file).parent / path  # an absolute path stays itself
    if not resolved.is_file():
        raise BadRow(f"image {path!r} not found (looked for {resolved}, relative paths are read from the data "
                     f"file's folder {Path(data_file).parent}): fix the path or add the file")
    return resolved


def load_image(path: Path) -> Image.Image:
    """The decoded image in RGB; a file PIL cannot decode is a BadRow naming it."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise BadRow(f"image {path} cannot be decoded ({err}): replace or remove it") from None


class Qwen2VLImages:
    """Qwen2-VL's layout of a row's images (the module docstring), from its image processor."""

    image_token, tokens = IMAGE_PAD, (VISION_START, IMAGE_PAD, VISION_END)
    grid_width = 3  # image_grid_thw's (t, h, w)

    def __init__(self, processor):
        self.processor = processor
        # One stored row of pixel_values: a patch, RGB x temporal x patch x patch floats.
        self.row_shape = (3 * processor.temporal_patch_size * processor.patch_size ** 2,)

    def token_counts(self, pixels: np.ndarray, grids: np.ndarray) -> list[int]:
        """The placeholder tokens each image takes: its patches merged merge_size x merge_size."""
        return [int(t * h * w) // self.processor.merge_size ** 2 for t, h, w in grids]

    def placeholder(self, count: int) -> str:
        return VISION_START + IMAGE_PAD * count + VISION_END

    def image_notes(self, pixels: np.ndarray, grids: np.ndarray) -> list[tuple[str, int, str]]:
        """Per image: its size, its image tokens and how they come (hpsft inspect-data)."""
        m = self.processor.merge_size
        return [(f"grid {t}x{h}x{w} patches", count, f"{t * h * w} patches / {m}x{m}")
                for (t, h, w), count in zip(grids.tolist(), self.token_counts(pixels, grids))]


class LlavaImages:
    """LLaVA's layout of a row's images (the module docstring): the folder's CLIP image processor
    and what of the model's config decides the image tokens. Passed to the data stage in place of
    the image processor (its to_dict keys the store)."""

    image_token = IMAGE_MARK
    tokens = (IMAGE_MARK,)
    grid_width = 0  # no image_grid_thw: one stored row of pixel_values is a whole image

    def __init__(self, processor, patch_size: int, feature_strategy: str, image_token_id: int):
        crop = processor.crop_size
        self.processor, self.patch_size, self.feature_strategy = processor, patch_size, feature_strategy
        self.image_token_id = image_token_id  # the config's: the tokenizer's <image> must be it
        self.row_shape = (3, crop["height"], crop["width"])

    def to_dict(self) -> dict:
        return {**self.processor.to_dict(), "llava patch_size": self.patch_size,
                "llava vision_feature_select_strategy": self.feature_strategy}

    def token_counts(self, pixels: np.ndarray, grids: np.ndarray) -> list[int]:
        """LlavaProcessor's count per image: (H // patch) * (W // patch) features, CLIP's CLS kept
        (+ 1) by the "full" strategy, dropped by "default"."""
        _, height, width = pixels.shape[1:]
        count = (height // self.patch_size) * (width // self.patch_size) + (self.feature_strategy == "full")
        return [count] * len(pixels)

    def placeholder(self, count: int) -> str:
        return IMAGE_MARK * count

    def image_notes(self, pixels: np.ndarray, grids: np.ndarray) -> list[tuple[str, int, str]]:
        """Per image: its size, its image tokens and how they come (hpsft inspect-data)."""
        _, height, width = pixels.shape[1:]
        p = self.patch_size
        how = f"{height // p}x{width // p} patches of {p}" + (" + CLS" if self.feature_strategy == "full" else "")
        return [(f"{height}x{width} pixels", count, how) for count in self.token_counts(pixels, grids)]


def image_layout(processor) -> Qwen2VLImages | LlavaImages:
    """The layout of what the data stage was handed: LlavaImages, or a Qwen2-VL image processor."""
    return processor if isinstance(processor, LlavaImages) else Qwen2VLImages(processor)


def process_images(processor, paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """pixel_values float32 [rows, *layout.row_shape] and image_grid_thw int64 [n_images,
    layout.grid_width] of the row's images, concatenated in order, as the processor gives them one
    image at a time (Qwen2-VL: a row per patch, a (t, h, w) grid per image; LLaVA: a row per image,
    no grid)."""
    layout = image_layout(processor)
    if not paths:
        return np.zeros((0, *layout.row_shape), np.float32), np.zeros((0, layout.grid_width), np.int64)
    outs = [layout.processor(images=load_image(path), return_tensors="np") for path in paths]
    pixels = np.concatenate([np.asarray(o["pixel_values"], np.float32) for o in outs])
    grids = (np.concatenate([np.asarray(o["image_grid_thw"], np.int64) for o in outs]) if layout.grid_width
             else np.zeros((len(outs), 0), np.int64))
    return pixels.reshape(-1, *layout.row_shape), grids


def image_token_counts(processor, pixels: np.ndarray, grids: np.ndarray) -> list[int]:
    """The number of placeholder tokens each image of process_images' output takes."""
    return image_layout(processor).token_counts(pixels, grids)


def expanded_messages(messages: list[dict], counts: list[int], processor) -> list[dict]:
    """The messages with the k-th IMAGE_MARK (in message order) replaced by the model's placeholder
    tokens for image k (the layout of `processor`): rendered and tokenized as any chat, the image tokens land in their user turn
    (outside the assistant mask) and count towards max_length."""
    marks = sum(m["content"].count(IMAGE_MARK) for m in messages if isinstance(m.get("content"), str))
    if marks != len(counts):
        raise BadRow(f"the messages hold {marks} {IMAGE_MARK} marks for {len(counts)} images: a text part that "
                     f"itself contains {IMAGE_MARK} is ambiguous; remove it from the text")
    placeholder = image_layout(processor).placeholder
    pending, out = iter(counts), []
    for msg in messages:
        if isinstance(msg.get("content"), str) and IMAGE_MARK in msg["content"]:
            pieces = msg["content"].split(IMAGE_MARK)
            text = [pieces[0]]
            for piece in pieces[1:]:
                text += [placeholder(next(pending)), piece]
            msg = {**msg, "content": "".join(text)}
        out.append(msg)
    return out
