"""Image chat rows -> the sequences they train and each sequence's image patches (the data stage
of a vision-language model).

A row's messages are read by its layout (hpsft/data/layouts.py), its images found and processed
(hpsft/data/image_rows.py), each image's placeholder expanded into as many image tokens as the
processor gives it, and the expanded conversation goes through the same rows_sequences as text
(chat template, assistant-only mask, data.max_length). The image tokens are in input_ids, so the
token budget (data.max_length, max_tokens_per_micro_batch, the rank balance) counts them.

A row with images must stay one sequence holding every image token: an image's features fill
exactly its placeholders, so a cut (data.truncation=left|right) or a split into turns would
leave patches without their tokens. Such a row is a BadRow naming what to change.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hpsft.data.chat_messages import IMAGES_COLUMN, BadRow
from hpsft.data.image_rows import expanded_messages, image_layout, image_messages, image_token_counts, process_images
from hpsft.data.layouts import HOUSE_LAYOUT, row_messages
from hpsft.data.row_sequences import RowSequences, rows_sequences
from hpsft.data.rows import TokenizeOptions
from hpsft.utils.files import file_identity


@dataclass
class ImageRowSequences:
    """A row's sequences (RowSequences) and, per sequence, its images' pixel_values
    [rows, *row_shape] and image_grid_thw [images, grid_width] (image_rows.py's layouts; zero rows
    for a text-only sequence); `image_files`: the file_identity of each image read, taken before
    reading it (the store prepares the shard again when one changes)."""

    sequences: RowSequences
    patches: list[tuple[np.ndarray, np.ndarray]]
    image_files: list[tuple[str, int, int]] = field(default_factory=list)


def image_rows_sequences(rows: list, tokenizer, processor, opts: TokenizeOptions,
                         data_file: Path) -> list[ImageRowSequences | BadRow]:
    """Each row's sequences and patches, or the BadRow it raised (the caller names its file and
    row); relative image paths are read from data_file's folder."""
    pending = []  # per row: (house row, pixels, grids, image tokens) or its BadRow
    for row in rows:
        try:
            messages, tools = row_messages(row, opts)
            messages, paths = image_messages(messages, row.get(IMAGES_COLUMN), data_file)
            identities = [file_identity(path) for path in paths]  # before the read: a later change is seen
            pixels, grids = process_images(processor, paths)
            counts = image_token_counts(processor, pixels, grids)
            house_row = {"messages": expanded_messages(messages, counts, processor), "tools": tools}
            pending.append((house_row, pixels, grids, sum(counts), identities))
        except BadRow as err:
            pending.append(err)
    house_opts = replace(opts, **HOUSE_LAYOUT)
    results = iter(rows_sequences([p[0] for p in pending if not isinstance(p, BadRow)], tokenizer, house_opts))
    layout = image_layout(processor)
    pad = tokenizer.convert_tokens_to_ids(layout.image_token)
    no_patches = (np.zeros((0, *layout.row_shape), np.float32), np.zeros((0, layout.grid_width), np.int64))
    out = []
    for p in pending:
        if isinstance(p, BadRow):
            out.append(p)
            continue
        _, pixels, grids, image_tokens, identities = p
        result = next(results)
        if isinstance(result, BadRow) or image_tokens == 0:
            out.append(result if isinstance(result, BadRow) else
                       ImageRowSequences(result, [no_patches] * len(result.sequences)))
            continue
        held = [sum(t == pad for t in ids) for ids, _ in result.sequences]
        if held != [image_tokens]:
            out.append(BadRow(f"the row's {len(grids)} images take {image_tokens} image tokens, which must stay whole "
                              f"in one sequence, but it became {len(held)} sequences holding {held} of them: set "
                              "data.multiturn=whole and raise data.max_length (data.truncation cannot cut image rows)"))
            continue
        out.append(ImageRowSequences(result, [(pixels, grids)], identities))
    return out
