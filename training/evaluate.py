"""Single-process prediction over a prepared split: no sampler padding, every text once."""

from __future__ import annotations

from functools import partial
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from training.data.dataset import EncodedSplit, pad_batch


@torch.no_grad()
def predict_proba(
    model: nn.Module,
    dataset: EncodedSplit,
    batch_size: int,
    min_len: int,
    device: torch.device = torch.device("cpu"),
    indices: Sequence[int] | None = None,
) -> np.ndarray:
    """Class probabilities, one row per text (of ``indices`` when given), in order."""
    data = dataset if indices is None else Subset(dataset, list(indices))
    loader = DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=partial(pad_batch, min_len=min_len))
    was_training = model.training
    model.eval()
    out = []
    for tokens, _ in loader:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(tokens.to(device, non_blocking=True))
        out.append(torch.softmax(logits.float(), dim=1).cpu().numpy())
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)
