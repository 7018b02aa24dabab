"""Image chat rows (hpsft/data/image_rows.py) on real photographs from scikit-image."""

import json

import numpy as np
import pytest
from PIL import Image
from skimage import data as photos
from transformers import Qwen2VLImageProcessorPil

from hpsft.data.chat_messages import BadRow
from hpsft.data.patch_store import MappedPatches, PatchWriter
from hpsft.data.chat_tokenize import tokenize_conversation
from hpsft.data.image_rows import (IMAGE_PAD, VISION_END, VISION_START, expanded_messages, image_messages,
                                   image_token_counts, process_images)


@pytest.fixture
def photo_dir(tmp_path):
    """Three photographs of different sizes in tmp_path/imgs, JPEG and PNG, and a data file beside them."""
    (tmp_path / "imgs").mkdir()
    Image.fromarray(photos.astronaut()).resize((112, 84)).save(tmp_path / "imgs" / "astronaut.jpg")
    Image.fromarray(photos.coffee()).resize((140, 112)).save(tmp_path / "imgs" / "coffee.png")
    Image.fromarray(photos.chelsea()).resize((56, 84)).save(tmp_path / "imgs" / "chelsea.jpg")
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("")
    return data_file


def parts_row():
    return [{"role": "user", "content": [{"type": "image", "image": "imgs/astronaut.jpg"},
                                         {"type": "text", "text": "and"},
                                         {"type": "image_url", "image_url": {"url": "imgs/coffee.png"}},
                                         {"type": "text", "text": "what are these?"}]},
            {"role": "assistant", "content": "An astronaut and a coffee."}]


def test_rows_resolve_images_against_the_data_file(photo_dir, tmp_path, monkeypatch):
    """Content parts and <image> placeholders give the same text and the images in order, read from
    the data file's folder whatever the cwd. Planted bug: resolve_image reads `Path(path)` (the cwd)
    instead of the data file's folder -> BadRow "image 'imgs/astronaut.jpg' not found"."""
    monkeypatch.chdir(tmp_path.parent)
    messages, paths = image_messages(parts_row(), None, photo_dir)
    assert messages[0]["content"] == "<image>and<image>what are these?"
    assert [p.name for p in paths] == ["astronaut.jpg", "coffee.png"]
    llava = [{"role": "user", "content": "<image>and<image>what are these?"},
             {"role": "assistant", "content": "An astronaut and a coffee."}]
    messages_llava, paths_llava = image_messages(llava, ["imgs/astronaut.jpg", "imgs/coffee.png"], photo_dir)
    assert messages_llava == messages and paths_llava == paths
    text_only = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert image_messages(text_only, None, photo_dir) == (text_only, [])


@pytest.mark.parametrize("change, error", [
    (lambda m, imgs: (m, imgs + ["imgs/chelsea.jpg"]), "2 <image> placeholders but its images column lists 3"),
    (lambda m, imgs: (m, ["imgs/astronaut.jpg", "imgs/missing.jpg"]), "image 'imgs/missing.jpg' not found"),
    (lambda m, imgs: (m, imgs[:1]), "2 <image> placeholders but its images column lists 1"),
    (lambda m, imgs: ([{**m[0], "content": [{"type": "image_url", "image_url": "https://x.org/a.jpg"}]}, m[1]],
                      None), "is a URL"),
    (lambda m, imgs: ([m[0], {**m[1], "content": "<image>"}], imgs + ["imgs/chelsea.jpg"]),
     "message 1 [(]assistant[)] holds an image: images go in user turns only"),
    (lambda m, imgs: ([{"role": "user", "content": "what?"},
                       {"role": "assistant", "content": [{"type": "image", "image": "imgs/chelsea.jpg"}]}], None),
     "message 1 [(]assistant[)] holds an image"),
])
def test_bad_image_rows_are_refused_by_name(photo_dir, change, error):
    """A wrong placeholder count (more images than marks, a mark without an image), a missing file, a
    URL and an image in an assistant turn (its tokens would be inside the loss mask; as a mark with an
    images column, or as a content part) are BadRows naming the image or message and the fix (the
    data stage adds the file and row: test_image_data_stage's missing-image case). Planted bugs: the
    placeholder count check dropped -> the first case raised nothing (DID NOT RAISE); the user-turn
    check dropped -> both assistant cases DID NOT RAISE."""
    llava = [{"role": "user", "content": "<image>and<image>what?"}, {"role": "assistant", "content": "ok"}]
    messages, images = change(llava, ["imgs/astronaut.jpg", "imgs/coffee.png"])
    with pytest.raises(BadRow, match=error):
        image_messages(messages, images, photo_dir)


def test_undecodable_image_is_refused(photo_dir):
    """A file PIL cannot decode is a BadRow naming it. Planted bug: load_image catching nothing ->
    PIL's UnidentifiedImageError escaped instead of the BadRow."""
    (photo_dir.parent / "imgs" / "broken.jpg").write_bytes(b"not a jpeg")
    _, paths = image_messages([{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}],
                              ["imgs/broken.jpg"], photo_dir)
    with pytest.raises(BadRow, match="broken.jpg cannot be decoded"):
        process_images(Qwen2VLImageProcessorPil(), paths)


def test_image_tokens_expand_as_the_processor_counts(photo_dir, tokenizer):
    """Each image becomes vision_start + grid_t*grid_h*grid_w/merge^2 pads + vision_end in the chat's
    token ids, outside the loss mask, which covers the same assistant tokens as the text-only chat;
    pixel_values and grids equal the processor's own call on each image, concatenated in order.
    Planted bug: image_token_counts divides by merge_size (not its square) -> 24 pads written for 12,
    the check that the pads stop after 12 failed."""
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
    processor = Qwen2VLImageProcessorPil()
    messages, paths = image_messages(parts_row(), None, photo_dir)
    pixels, grids = process_images(processor, paths)
    counts = image_token_counts(processor, pixels, grids)
    ids, mask = tokenize_conversation(tokenizer, expanded_messages(messages, counts, processor))
    pad, start, end = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VISION_START, VISION_END])
    starts = [i for i, t in enumerate(ids) if t == start]
    assert len(starts) == 2 and ids.count(end) == 2
    for begin, (t, h, w) in zip(starts, grids):
        n = t * h * w // processor.merge_size ** 2
        assert ids[begin + 1: begin + 1 + n] == [pad] * n and ids[begin + 1 + n] == end
    assert not any(m for t, m in zip(ids, mask) if t in (pad, start, end))
    text_ids, text_mask = tokenize_conversation(tokenizer, [{**messages[0], "content": "what are these?"}, messages[1]])
    assert [t for t, m in zip(ids, mask) if m] == [t for t, m in zip(text_ids, text_mask) if m]
    for path, (lo, hi) in zip(paths, [(0, grids[0].prod()), (grids[0].prod(), grids.prod(axis=1).sum())]):
        own = processor(images=Image.open(path).convert("RGB"), return_tensors="np")
        np.testing.assert_array_equal(pixels[lo:hi], own["pixel_values"])
    assert grids.dtype == np.int64 and pixels.dtype == np.float32
    assert json.dumps(grids.tolist()) == json.dumps([[1, 6, 8], [1, 8, 10]])


def test_patches_read_back_exactly_from_the_map(photo_dir):
    """Sequences' patches written beside a shard read back, mapped, as the processor gave them, each
    sequence its own (one with two images, a text-only one, one with one image). Planted bug:
    MappedPatches.__getitem__ reads patch_offsets[i + 1]:[i + 2] (its neighbour's) -> sequence 0 read
    0 patches (the text-only neighbour's) for its 128."""
    processor = Qwen2VLImageProcessorPil()
    imgs = photo_dir.parent / "imgs"
    sequences = [process_images(processor, [imgs / "astronaut.jpg", imgs / "coffee.png"]),
                 process_images(processor, []), process_images(processor, [imgs / "chelsea.jpg"])]
    shard = photo_dir.parent / "shard-00000.arrow"
    patch_dim = sequences[0][0].shape[1]
    writer = PatchWriter(shard, (patch_dim,), 3)
    for pixels, grids in sequences:
        writer.add(pixels.reshape(-1, patch_dim), grids)
    writer.close()
    mapped = MappedPatches(shard)
    assert len(mapped) == 3 and isinstance(mapped.pixels, np.memmap)
    for i, (pixels, grids) in enumerate(sequences):
        got_pixels, got_grids = mapped[i]
        np.testing.assert_array_equal(got_pixels, pixels.reshape(-1, patch_dim))
        np.testing.assert_array_equal(got_grids, grids)
