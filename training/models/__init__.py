"""Model families, built from the config: ``build_model(model_cfg, vocab_size, num_classes)``."""

from __future__ import annotations

from torch import nn

from training.config import ModelConfig
from training.models.textcnn import TextCNN

FAMILIES = {"textcnn": TextCNN}


def build_model(cfg: ModelConfig, vocab_size: int, num_classes: int) -> nn.Module:
    return FAMILIES[cfg.name].from_config(cfg, vocab_size, num_classes)


def min_input_len(cfg: ModelConfig) -> int:
    """Shortest token sequence the model accepts (the widest convolution)."""
    return max(cfg.kernel_sizes) if cfg.name == "textcnn" else 1
