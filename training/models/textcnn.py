"""TextCNN (Kim, 2014): embeddings -> parallel 1-D convolutions -> max over time -> linear."""

from __future__ import annotations

import torch
from torch import nn

from training.config import ModelConfig


class TextCNN(nn.Module):
    def __init__(self, vocab_size: int, num_classes: int, embed_dim: int, num_filters: int,
                 kernel_sizes: list[int], dropout: float):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        nn.init.normal_(self.embedding.weight, std=0.1)
        with torch.no_grad():
            self.embedding.weight[0].zero_()
        self.convs = nn.ModuleList(nn.Conv1d(embed_dim, num_filters, k) for k in kernel_sizes)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(num_filters * len(kernel_sizes), num_classes)

    @classmethod
    def from_config(cls, cfg: ModelConfig, vocab_size: int, num_classes: int) -> "TextCNN":
        return cls(vocab_size, num_classes, cfg.embed_dim, cfg.num_filters, cfg.kernel_sizes, cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (batch, seq) ids, 0 = padding -> logits (batch, classes)."""
        x = self.embedding(tokens).transpose(1, 2)  # (batch, embed, seq)
        pooled = [torch.relu(conv(x)).amax(dim=2) for conv in self.convs]
        return self.classifier(self.dropout(torch.cat(pooled, dim=1)))
