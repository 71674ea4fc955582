"""Read a prepared split back as a torch Dataset (ranks never tokenize)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class EncodedSplit(Dataset):
    """Token ids of one split, truncated to ``max_len``; memory-mapped, so every rank shares the pages."""

    def __init__(self, prepared_dir: str | Path, split: str, max_len: int):
        root = Path(prepared_dir)
        self.ids = np.load(root / f"{split}.ids.npy", mmap_mode="r")
        self.offsets = np.load(root / f"{split}.offsets.npy")
        self.labels = np.load(root / f"{split}.labels.npy")
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        end = min(end, start + self.max_len)
        return torch.from_numpy(np.array(self.ids[start:end], dtype=np.int64)), int(self.labels[i])


def pad_batch(batch: list[tuple[torch.Tensor, int]], min_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad with id 0 to the longest text of the batch (at least ``min_len``, the widest kernel)."""
    width = max(min_len, max(len(ids) for ids, _ in batch))
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    for row, (ids, _) in enumerate(batch):
        tokens[row, : len(ids)] = ids
    labels = torch.tensor([label for _, label in batch], dtype=torch.long)
    return tokens, labels
