"""SFT dataset: the rows of data files (hpsft/data/rows.py) -> their sequences
(hpsft/data/row_sequences.py) -> tokenized, cached examples.

Tokenization runs once per set of inputs and is cached on disk (flat int32 tokens + offsets), keyed by the files' contents,
the tokenizer, the template and the options that change the result.
"""

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from hpsft.data import chat_messages, chat_tokenize, row_sequences as row_sequences_module, rows as rows_module
from hpsft.data.chat_messages import BadRow
from hpsft.data.row_sequences import row_sequences
from hpsft.data.rows import DataError, TokenizeOptions, read_rows
from hpsft.files import load_plain_data, umask_mode
from hpsft.progress import progress_bar


def tokenize_files(files: list[Path], tokenizer, opts: TokenizeOptions, progress: bool = False) -> dict:
    tokens, masks, lengths, skipped = [], [], [], 0
    with progress_bar(progress, desc="tokenize", unit="row") as bar:  # no total: rows are counted as read
        for path in files:
            for row_idx, row in enumerate(read_rows(path)):
                bar.update(1)
                try:
                    sequences = row_sequences(row, tokenizer, opts).sequences
                except BadRow as err:
                    if opts.bad_rows == "skip":
                        skipped += 1
                        continue
                    raise DataError(f"{path} row {row_idx}: {err} (set data.bad_rows=skip to skip such rows)") from None
                for ids, mask in sequences:
                    tokens.extend(ids)
                    masks.extend(mask)
                    lengths.append(len(ids))
    if not lengths:
        raise DataError(f"no usable rows in {[str(f) for f in files]}")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return {
        "input_ids": torch.tensor(tokens, dtype=torch.int32),
        "loss_mask": torch.tensor(masks, dtype=torch.bool),
        "offsets": offsets,
        "skipped_rows": skipped,
    }


def cache_key(files: list[Path], tokenizer, opts: TokenizeOptions) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.resolve()).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    h.update(json.dumps(opts.__dict__, sort_keys=True).encode())
    h.update(str(tokenizer.name_or_path).encode())
    h.update(str(len(tokenizer)).encode())
    h.update(str(tokenizer.chat_template).encode())
    # The rules that turn rows into tokens and masks are part of the result: a cache written
    # under other rules must not be reused.
    for module in (chat_messages, chat_tokenize, rows_module, row_sequences_module):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:24]


def load_or_tokenize(files: list[str], tokenizer, opts: TokenizeOptions, cache_dir: str | Path,
                     progress: bool = False) -> dict:
    """Tokenized data of `files`, from the cache when present; written atomically. `progress`:
    a progress bar while tokenizing (on a terminal)."""
    files = [Path(f) for f in files]
    for path in files:
        if not path.is_file():
            raise DataError(f"data file {path} does not exist")
    if opts.chat_template is None and tokenizer.chat_template is None:
        raise DataError(f"the tokenizer of {tokenizer.name_or_path} has no chat template: name one with "
                        "data.chat_template=<Jinja text or .jinja file>")
    cache_path = Path(cache_dir) / f"{cache_key(files, tokenizer, opts)}.pt"
    if cache_path.is_file():
        return load_plain_data(cache_path)
    try:  # before tokenizing, which can take long
        cache_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"data.cache_dir={cache_dir}: cannot write the tokenized data there ({err.strerror}); "
                        "choose another data.cache_dir") from None
    data = tokenize_files(files, tokenizer, opts, progress)
    fd, tmp = tempfile.mkstemp(prefix=cache_path.name + ".", dir=cache_path.parent)
    os.fchmod(fd, umask_mode())  # mkstemp's 0600 would ignore the user's umask
    os.close(fd)
    torch.save(data, tmp)
    os.replace(tmp, cache_path)
    return data


class SFTDataset(torch.utils.data.Dataset):
    """Indexable view of tokenized data: item i is {input_ids, loss_mask} (1-D tensors)."""

    def __init__(self, data: dict):
        self.input_ids = data["input_ids"]
        self.loss_mask = data["loss_mask"]
        self.offsets = data["offsets"]
        self.skipped_rows = data["skipped_rows"]

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def seqlen(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def __getitem__(self, i: int) -> dict:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return {
            "input_ids": self.input_ids[start:end].long(),
            "loss_mask": self.loss_mask[start:end],
            "index": i,
        }
