"""Image chat rows: hpsft's row path (image_rows: resolve, decode, process each image, expand its
placeholder tokens, tokenize and mask the chat, write its patches beside the shard) against the
processor's own batch call on the same decoded images (pixels only: no text, no storage).
One process; scikit-image's photographs (astronaut, coffee, chelsea) at three sizes, two images a row.

    python benchmarks/bench_image_rows.py [--rows N] [--model DIR]
"""

import argparse
import tempfile
import time
from pathlib import Path

from PIL import Image
from skimage import data as photos
from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

from hpsft.data.chat_tokenize import tokenize_conversation
from hpsft.data.image_rows import (IMAGE_PAD, VISION_END, VISION_START, expanded_messages, image_messages,
                                   image_token_counts, load_image, process_images)
from hpsft.data.patch_store import PatchWriter


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--model", default=".cache/models/smollm2-135m-2l")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
    processor = Qwen2VLImageProcessorPil()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        names = []
        for name, size in (("astronaut", (224, 168)), ("coffee", (280, 224)), ("chelsea", (168, 224))):
            Image.fromarray(getattr(photos, name)()).resize(size).save(folder / f"{name}.jpg")
            names.append(f"{name}.jpg")
        rows = [([{"role": "user", "content": "<image> vs <image>: which is warmer?"},
                  {"role": "assistant", "content": "The coffee, by far."}], [names[i % 3], names[(i + 1) % 3]])
                for i in range(args.rows)]
        data_file = folder / "train.jsonl"
        start = time.perf_counter()
        writer = PatchWriter(folder / "shard-00000.arrow", 3 * 2 * 14 * 14)
        tokens = 0
        for messages, images in rows:
            messages, paths = image_messages(messages, images, data_file)
            pixels, grids = process_images(processor, paths)
            ids, _ = tokenize_conversation(tokenizer, expanded_messages(messages, image_token_counts(grids, 2)))
            writer.add(pixels, grids)
            tokens += len(ids)
        writer.close()
        ours = time.perf_counter() - start
        start = time.perf_counter()
        decoded = [load_image(folder / name) for _, images in rows for name in images]
        processor(images=decoded, return_tensors="np")
        theirs = time.perf_counter() - start
    print(f"| path | image rows/s | ratio |\n|---|---|---|\n"
          f"| processor batch call (decode + pixels only) | {args.rows / theirs:.1f} | 1.00 |\n"
          f"| hpsft image rows (decode, pixels, tokens, mask, patch file) | {args.rows / ours:.1f} | "
          f"{theirs / ours:.2f} |\n({args.rows} rows, 2 images each, {tokens} tokens)")


if __name__ == "__main__":
    main()
