"""Read a prepared split back as a torch Dataset (ranks never tokenize).

Items are ``({"word": ids, "char": ids}, label)`` with the inputs the model
asks for, each cut at its limit; the family's ``collate`` pads a batch
(``EncodedSplit.collate``, set by ``training.evaluate.open_split``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

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

    def lengths(self) -> np.ndarray:
        """Each text's tokens over all its inputs, cut at their limits: what it adds to its batch's padded width."""
        total = np.zeros(len(self), dtype=np.int64)
        for name, (_, offsets) in self.arrays.items():
            total += np.minimum(np.diff(offsets.astype(np.int64)), self.limits[name])
        return total

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], int]:
        item = {}
        for name, (ids, offsets) in self.arrays.items():
            start, end = int(offsets[i]), int(offsets[i + 1])
            end = min(end, start + self.limits[name])
            item[name] = torch.from_numpy(np.array(ids[start:end], dtype=np.int64))
        return item, int(self.labels[i])


class LengthGroupedSampler(Sampler[int]):
    """``DistributedSampler``'s contract (this rank's share of a seeded shuffle of the split, the same number of texts
    on every rank, ``set_epoch``), with the texts of one optimiser step of similar length. Texts are padded to their
    batch's longest, and under DDP a step waits for the rank with the widest batch: with random batches a step of 2
    ranks pads like the longer of two batches (about 1.1x one batch's tokens on the built-in corpus), and every
    batch pads to its longest text. Here the shuffled split is cut into groups of ``group`` steps' texts, each group
    sorted by length and cut into steps
    of ``batch_size`` texts per rank, and the steps are shuffled (the last, shorter one stays last): the ranks of a
    step get neighbouring lengths and little padding, while which texts meet in a step changes every epoch (the
    ``group_by_length`` of Hugging Face's Trainer, extended across the ranks)."""

    def __init__(self, lengths: np.ndarray, batch_size: int, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 group: int = 50):
        self.lengths = np.asarray(lengths)
        self.batch_size, self.num_replicas, self.rank, self.seed, self.group = batch_size, num_replicas, rank, seed, group
        self.epoch = 0
        self.total = math.ceil(len(self.lengths) / num_replicas) * num_replicas  # padded by repeating texts, as DistributedSampler

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.total // self.num_replicas

    def steps(self) -> list[np.ndarray]:
        """Every step's texts (all ranks'), in this epoch's order; the same on every rank."""
        if not self.total:
            return []
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.lengths))
        order = np.resize(order, self.total)  # the first texts again at the end, up to a multiple of the ranks
        width = self.batch_size * self.num_replicas
        steps = []
        for start in range(0, self.total, width * self.group):
            block = order[start:start + width * self.group]
            block = block[np.argsort(-self.lengths[block], kind="stable")]
            steps += [block[i:i + width] for i in range(0, len(block), width)]
        last = [steps.pop()] if len(steps[-1]) < width else []
        return [steps[i] for i in rng.permutation(len(steps))] + last

    def __iter__(self):
        for step in self.steps():
            share = len(step) // self.num_replicas
            yield from step[self.rank * share:(self.rank + 1) * share].tolist()


def train_sampler(dataset, train, num_replicas: int = 1, rank: int = 0) -> Sampler[int]:
    """The training sampler ``train`` (a TrainConfig) asks for: texts grouped by length (``train.group_by_length``) or
    drawn at random, this rank's share, seeded by ``train.seed``."""
    from torch.utils.data import DistributedSampler

    if train.group_by_length:
        return LengthGroupedSampler(dataset.lengths(), train.batch_size, num_replicas, rank, train.seed)
    return DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=train.seed)


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
