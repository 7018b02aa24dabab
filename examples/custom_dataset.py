"""An example dataset class for data.custom_cls (docs/data.md, "A dataset class of your own").

Plain text instead of chats: each row of a JSONL file is {"text": "..."}; every token of the
text is trained on (continued pre-training on the model's own tokenizer, no chat template).

    hpsft train data.custom_cls.path=examples/custom_dataset.py data.custom_cls.name=TextDataset \
        'data.train_files=[notes.jsonl]'
"""

import json

import torch


class TextDataset(torch.utils.data.Dataset):
    def __init__(self, data_files, tokenizer, config):
        self.examples = []
        for path in data_files:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        ids = tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]
                        self.examples.append(ids[:config.max_length])  # right truncation

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        ids = torch.tensor(self.examples[i], dtype=torch.int64)
        return {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
