"""A data.custom_cls without __getitem__: refused by name (tests/data/malformed/cases.yaml)."""

import torch


class NoGetItem(torch.utils.data.Dataset):  # torch's base __getitem__ only raises: not enough
    def __init__(self, data_files, tokenizer, config):
        self.rows = list(data_files)

    def __len__(self):
        return len(self.rows)
