"""Read a prepared split back as a torch Dataset (ranks never tokenize).

Items are ``({"word": ids, "char": ids}, label)`` with the inputs the model
asks for, each cut at its limit; the family's ``collate`` pads a batch
(``EncodedSplit.collate``, set by ``training.evaluate.open_split``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

FILES = {"word": ("ids", "offsets"), "char": ("char_ids", "char_offsets"), "tokens": ("tokens_ids", "tokens_offsets")}


class EncodedSplit(Dataset):
    """Token ids of one split, truncated; memory-mapped, so every rank shares the pages."""

    def __init__(self, prepared_dir: str | Path, split: str, limits: dict[str, int], inputs: tuple[str, ...] = ("word",),
                 collate=None):
        root = Path(prepared_dir)
        self.inputs = inputs
        self.limits = limits
        self.collate = collate or pad_batch
        self.arrays = {
            name: (np.load(root / f"{split}.{FILES[name][0]}.npy", mmap_mode="r"), np.load(root / f"{split}.{FILES[name][1]}.npy"))
            for name in inputs
        }
        self.labels = np.load(root / f"{split}.labels.npy")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], int]:
        item = {}
        for name, (ids, offsets) in self.arrays.items():
            start, end = int(offsets[i]), int(offsets[i + 1])
            end = min(end, start + self.limits[name])
            item[name] = torch.from_numpy(np.array(ids[start:end], dtype=np.int64))
        return item, int(self.labels[i])


def pad_batch(batch: list, min_len: int = 1, pad_id: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-pad each input with ``pad_id`` to the longest text of the batch (at least ``min_len``, the widest kernel)."""
    if not isinstance(batch[0][0], dict):  # a bare (ids, label) list: word input
        batch = [({"word": ids}, label) for ids, label in batch]
    padded = {}
    for name in batch[0][0]:
        width = max(min_len, max(len(item[name]) for item, _ in batch))
        tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, (item, _) in enumerate(batch):
            tokens[row, : len(item[name])] = item[name]
        padded[name] = tokens
    labels = torch.tensor([label for _, label in batch], dtype=torch.long)
    return padded, labels


def to_device(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: t.to(device, non_blocking=True) for name, t in inputs.items()}
