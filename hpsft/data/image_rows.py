"""Image chat rows: the images of a row found, resolved and decoded, and the text each becomes.

Two row shapes carry images:
- OpenAI-style messages whose content is a list of parts: `{"type": "text", "text": ...}`,
  `{"type": "image", "image": path}` or `{"type": "image_url", "image_url": {"url": path} | path}`
  with a local path (a `file://` prefix is allowed); http(s) and data URLs are refused (no fetching);
- ShareGPT/LLaVA-style rows whose text holds `<image>` placeholders, one per entry of the row's
  `images` column (a list of paths), in order.
Relative paths are resolved against the folder of the data file, never the working directory.
Each image becomes IMAGE_MARK in its message's text; expanded_messages replaces every mark by the
model's placeholder tokens, as many as the processor gives for that image (Qwen2-VL:
`<|vision_start|>` + grid_t*grid_h*grid_w / merge_size**2 x `<|image_pad|>` + `<|vision_end|>`).
"""

from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from hpsft.data.chat_messages import BadRow

IMAGE_MARK = "<image>"
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
            text, part_paths = flatten_parts(i, content)
            msg = {**msg, "content": text}
            paths += part_paths
        out.append(msg)
    if paths and images:
        raise BadRow("the row has both image content parts and an images column: give its images one way")
    if images:
        marks = sum(m["content"].count(IMAGE_MARK) for m in out if isinstance(m.get("content"), str))
        if marks != len(images):
            raise BadRow(f"the row's text has {marks} {IMAGE_MARK} placeholders but its images column lists "
                         f"{len(images)} images: put one {IMAGE_MARK} in the text where each image goes")
        paths = list(images)
    return out, [resolve_image(path, data_file) for path in paths]


def flatten_parts(i: int, parts) -> tuple[str, list[str]]:
    """One message's content parts as text with an IMAGE_MARK per image, and the image paths."""
    text, paths = [], []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url"):
            paths.append(part_path(f"message {i} part {j}", part, kind))
            text.append(IMAGE_MARK)
        else:
            raise BadRow(f"message {i} part {j} must be {{'type': 'text', 'text'}} or {{'type': 'image', "
                         f"'image': path}}, got {part!r:.80}")
    return "".join(text), paths


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


def process_images(processor, paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """pixel_values float32 [patches, patch_dim] and image_grid_thw int64 [n_images, 3] of the
    row's images, concatenated in order, as the processor gives them one image at a time."""
    if not paths:
        return np.zeros((0, 0), np.float32), np.zeros((0, 3), np.int64)
    outs = [processor(images=load_image(path), return_tensors="np") for path in paths]
    pixels = np.concatenate([np.asarray(o["pixel_values"], np.float32) for o in outs])
    grids = np.concatenate([np.asarray(o["image_grid_thw"], np.int64) for o in outs])
    return pixels, grids


def image_token_counts(grids: np.ndarray, merge_size: int) -> list[int]:
    """The number of placeholder tokens each image takes: its patches merged merge_size x merge_size."""
    return [int(t * h * w) // merge_size ** 2 for t, h, w in grids]


def expanded_messages(messages: list[dict], counts: list[int]) -> list[dict]:
    """The messages with the k-th IMAGE_MARK (in message order) replaced by the model's placeholder
    tokens for image k: rendered and tokenized as any chat, the image tokens land in their user turn
    (outside the assistant mask) and count towards max_length."""
    marks = sum(m["content"].count(IMAGE_MARK) for m in messages if isinstance(m.get("content"), str))
    if marks != len(counts):
        raise BadRow(f"the messages hold {marks} {IMAGE_MARK} marks for {len(counts)} images: a text part that "
                     f"itself contains {IMAGE_MARK} is ambiguous; remove it from the text")
    pending, out = iter(counts), []
    for msg in messages:
        if isinstance(msg.get("content"), str) and IMAGE_MARK in msg["content"]:
            pieces = msg["content"].split(IMAGE_MARK)
            text = [pieces[0]]
            for piece in pieces[1:]:
                text += [VISION_START, IMAGE_PAD * next(pending), VISION_END, piece]
            msg = {**msg, "content": "".join(text)}
        out.append(msg)
    return out
