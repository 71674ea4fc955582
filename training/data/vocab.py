"""Vocabulary from the train split only, and encoding to flat int32 arrays."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

PAD, UNK = "<pad>", "<unk>"  # ids 0 and 1


def build_vocab(token_lists: Iterable[list[str]], min_freq: int = 1, max_size: int | None = None) -> list[str]:
    """Specials first, then tokens by descending count (ties by token, for determinism)."""
    counts = Counter(tok for tokens in token_lists for tok in tokens)
    ranked = sorted((tok for tok, n in counts.items() if n >= min_freq), key=lambda t: (-counts[t], t))
    if max_size is not None:
        ranked = ranked[: max(0, max_size - 2)]
    return [PAD, UNK] + ranked


def encode(token_lists: list[list[str]], stoi: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """All texts' ids end to end (int32) and the offsets where each starts (int64, length n+1)."""
    unk = stoi[UNK]
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    offsets = np.zeros(len(token_lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter((stoi.get(tok, unk) for tokens in token_lists for tok in tokens), dtype=np.int32, count=int(offsets[-1]))
    return ids, offsets
