"""Single-process prediction over a prepared split: no sampler padding, every text once."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from training.data.dataset import EncodedSplit, to_device


@torch.no_grad()
def predict_proba(
    model: nn.Module,
    dataset: EncodedSplit,
    batch_size: int,
    device: torch.device = torch.device("cpu"),
    indices: Sequence[int] | None = None,
    precision: str = "auto",
) -> np.ndarray:
    """Class probabilities, one row per text (of ``indices`` when given), in order; the forward pass under
    ``precision`` (``train.precision``). Batched longest texts first, so that each batch is padded to about its own
    texts' length."""
    rows = np.arange(len(dataset)) if indices is None else np.asarray(indices, dtype=np.int64)
    order = np.argsort(-dataset.lengths()[rows], kind="stable") if hasattr(dataset, "lengths") else np.arange(len(rows))
    data = Subset(dataset, rows[order].tolist())
    loader = DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=dataset.collate)
    was_training = model.training
    model.eval()
    out = []
    for inputs, _ in loader:
        with autocast(precision, device):
            logits = model(to_device(inputs, device))
        out.append(torch.softmax(logits.float(), dim=1).cpu().numpy())
    model.train(was_training)
    if not out:
        return np.zeros((0, 0), dtype=np.float32)
    probs = np.empty_like(merged := np.concatenate(out))
    probs[order] = merged
    return probs


def serving_copy(model: nn.Module, precision: str) -> tuple[nn.Module, str]:
    """What predicts under ``precision`` when serving: for ``bf16``, a copy of ``model`` with bf16 weights run without
    autocast (autocast casts every weight at every call and keeps softmax and LayerNorm in fp32; on a CPU with AMX
    the bf16 copy was about 1.2x faster again, BENCHMARKS.md, pretrained family); otherwise the model itself."""
    if precision != "bf16":
        return model, precision
    import copy

    return copy.deepcopy(model).to(torch.bfloat16).eval(), "fp32"


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast type of ``train.precision`` on ``device`` (None: fp32)."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if precision == "fp16" and device.type != "cuda":
        from training.config import ConfigError

        raise ConfigError("train.precision: fp16 needs a CUDA device (its gradient scaler is CUDA's); use bf16 on a CPU")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def check_precision(config) -> None:
    """fp16 on a machine without CUDA: refused before any work (the worker would refuse it on every rank, and
    torchrun restart it for nothing)."""
    from training.config import ConfigError

    for field, train in (("train", config.train), ("distill.train", config.distill.train)):
        if train.precision == "fp16" and (field == "train" or config.distill.enabled) and not torch.cuda.is_available():
            raise ConfigError(f"{field}.precision: fp16 needs a CUDA device (its gradient scaler is CUDA's) and this "
                              "machine has none; use bf16 or fp32")


def autocast(precision: str, device: torch.device):
    dtype = autocast_dtype(precision, device)
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def open_split(prepared_dir, split: str, model_cfg, max_len: int, sizes: dict | None = None) -> EncodedSplit:
    """The split with the inputs ``model_cfg``'s family reads, cut at its limits, batched by its ``collate``."""
    from training.data.prepare import load_manifest
    from training.models import family_of

    family = family_of(model_cfg)
    sizes = sizes or family.sizes(load_manifest(prepared_dir), model_cfg, max_len)
    return EncodedSplit(prepared_dir, split, family.limits(model_cfg, max_len), family.inputs(model_cfg),
                        family.collate(model_cfg, sizes))


def load_model(checkpoint: str):
    """A model rebuilt from a verified checkpoint (architecture and vocabulary sizes travel inside)."""
    from training.checkpoint import CheckpointError, load_checkpoint
    from training.config import ModelConfig
    from training.models import family_of

    state = load_checkpoint(checkpoint)
    if any(k.split(".")[2:4] == ["encoder", "layers"] for k in state["model"]):
        raise CheckpointError(f"{checkpoint}: a transformer saved by zhflow before 0.2 (nn.TransformerEncoder layers); "
                              "its layers are now written out so that pruning can shrink them: retrain it")
    cfg = ModelConfig.model_validate(state["model_config"])
    family = family_of(cfg)
    state["sizes"] = family.checkpoint_sizes(state)
    model = family.build(cfg, state["sizes"], state["num_classes"])
    model.load_state_dict(state["model"])
    return model, cfg, state


def split_macro_f1(model: nn.Module, model_cfg, prepared_dir, split: str, max_len: int, batch_size: int = 256) -> float:
    """Macro-F1 of ``model`` on one prepared split."""
    from sklearn.metrics import f1_score

    data = open_split(prepared_dir, split, model_cfg, max_len)
    return float(f1_score(data.labels, predict_proba(model, data, batch_size).argmax(1), average="macro"))
