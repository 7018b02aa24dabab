"""Image chat rows: hpsft's row path (image_rows: resolve, decode, process each image, expand its
placeholder tokens, tokenize and mask the chat, write its patches beside the shard) against the
processor's own batch call on the same decoded images (pixels only: no text, no storage), and
the whole data stage (`prepared_store` of a JSONL file of the same rows into a fresh cache: shard
plan, worker processes started by forkserver, rows read, the row path, Arrow + patch files,
sidecars, manifest, the store opened) over 1 and 2 processes, against the same batch call timed in
the same run. scikit-image's photographs (astronaut, coffee, chelsea) at three sizes, two images a row.

    python benchmarks/bench_image_rows.py [--rows N] [--model DIR]
"""

import argparse
import json
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
from hpsft.data.preparation import LocalRunner, prepared_store
from hpsft.data.rows import TokenizeOptions


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--stage-rows", type=int, default=600, help="rows of the data-stage rows")
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
        writer = PatchWriter(folder / "shard-00000.arrow", (3 * 2 * 14 * 14,), 3)
        tokens = 0
        for messages, images in rows:
            messages, paths = image_messages(messages, images, data_file)
            pixels, grids = process_images(processor, paths)
            ids, _ = tokenize_conversation(tokenizer, expanded_messages(messages, image_token_counts(processor, pixels, grids), processor))
            writer.add(pixels, grids)
            tokens += len(ids)
        writer.close()
        ours = time.perf_counter() - start
        start = time.perf_counter()
        decoded = [load_image(folder / name) for _, images in rows for name in images]
        processor(images=decoded, return_tensors="np")
        theirs = time.perf_counter() - start
        stage = data_stage_rows(folder, names, tokenizer, processor, args.stage_rows)
    print(f"| path | image rows/s | ratio |\n|---|---|---|\n"
          f"| processor batch call (decode + pixels only) | {args.rows / theirs:.1f} | 1.00 |\n"
          f"| hpsft image rows (decode, pixels, tokens, mask, patch file) | {args.rows / ours:.1f} | "
          f"{theirs / ours:.2f} |\n({args.rows} rows, 2 images each, {tokens} tokens)\n")
    print(stage)


def data_stage_rows(folder: Path, names: list[str], tokenizer, processor, n: int) -> str:
    """The data stage end to end over 1 and 2 processes vs the processor's batch call on the same
    n rows' images (decoded here), timed in this run; a table."""
    rows = [{"messages": [{"role": "user", "content": "<image> vs <image>: which is warmer?"},
                          {"role": "assistant", "content": "The coffee, by far."}],
             "images": [names[i % 3], names[(i + 1) % 3]]} for i in range(n)]
    data_file = folder / "stage.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    opts = TokenizeOptions(messages_key=None, prompt_key=None, response_key=None, tools_key="tools",
                           chat_template=None, max_length=1024, truncation="right", bad_rows="error")
    shard_mb = data_file.stat().st_size / 8 / 2**20  # 8 shards: both processes busy to the end
    lines = ["| path | processes | image rows/s | ratio to the batch call | patches written | seconds |",
             "|---|---|---|---|---|---|"]
    start = time.perf_counter()
    processor(images=[load_image(folder / name) for row in rows for name in row["images"]], return_tensors="np")
    theirs = time.perf_counter() - start
    lines.append(f"| processor batch call (decode + pixels only) | 1 | {n / theirs:.1f} | 1.00 | - | {theirs:.2f} |")
    for procs in (1, 2):
        start = time.perf_counter()
        store = prepared_store(str(data_file), tokenizer, opts, folder / f"cache-{procs}", LocalRunner(procs),
                               shard_mb=shard_mb, processor=processor)
        seconds = time.perf_counter() - start
        patches = sum(p.pixels.shape[0] for p in store.patches)
        lines.append(f"| hpsft data stage (prepared_store, {len(store.summary['shards'])} shards) | {procs} | "
                     f"{n / seconds:.1f} | {theirs / seconds:.2f} | {patches} | {seconds:.2f} |")
    return "\n".join(lines) + f"\n({n} rows, 2 images each, {store.summary['tokens']} tokens)"


if __name__ == "__main__":
    main()
