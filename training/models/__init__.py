"""Model families, built from the config.

Every family is an *encoder* (ids -> one feature vector per text); the
classifier puts one encoder on words, one on characters, or both, and
concatenates their features before dropout and a linear layer.

    model = build_model(cfg.model, vocab_sizes={"word": 20000, "char": 5000}, num_classes=2)
    logits = model({"word": word_ids})   # (batch, seq) int64, 0 = padding
"""

from __future__ import annotations

import torch
from torch import nn

from training.config import ModelConfig
from training.models.bilstm import BiLSTMEncoder
from training.models.textcnn import TextCNNEncoder
from training.models.transformer import TransformerEncoder

FAMILIES = {"textcnn": TextCNNEncoder, "bilstm": BiLSTMEncoder, "transformer": TransformerEncoder}


def model_inputs(cfg: ModelConfig) -> tuple[str, ...]:
    return ("word", "char") if cfg.input == "both" else (cfg.input,)


class TextClassifier(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_sizes: dict[str, int], num_classes: int):
        super().__init__()
        self.inputs = model_inputs(cfg)
        self.encoders = nn.ModuleDict({name: FAMILIES[cfg.name](cfg, vocab_sizes[name]) for name in self.inputs})
        width = sum(enc.out_dim for enc in self.encoders.values())
        self.dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        features = [self.encoders[name](batch[name]) for name in self.inputs]
        return self.classifier(self.dropout(torch.cat(features, dim=1)))


def build_model(cfg: ModelConfig, vocab_sizes: dict[str, int] | int, num_classes: int) -> TextClassifier:
    if isinstance(vocab_sizes, int):
        vocab_sizes = {"word": vocab_sizes, "char": vocab_sizes}
    return TextClassifier(cfg, vocab_sizes, num_classes)


def min_input_len(cfg: ModelConfig) -> int:
    """Shortest token sequence the model accepts (the widest convolution)."""
    return max(cfg.kernel_sizes) if cfg.name == "textcnn" else 1
