"""TextCNN (Kim, 2014): embeddings -> parallel 1-D convolutions -> max over time."""

from __future__ import annotations

import torch
from torch import nn

from training.config import ModelConfig


def make_embedding(vocab_size: int, dim: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab_size, dim, padding_idx=0)
    nn.init.normal_(embedding.weight, std=0.1)  # on the scale of the layers' weights, so global pruning is fair
    with torch.no_grad():
        embedding.weight[0].zero_()
    return embedding


class TextCNNEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.embedding = make_embedding(vocab_size, cfg.embed_dim)
        self.convs = nn.ModuleList(nn.Conv1d(cfg.embed_dim, cfg.num_filters, k) for k in cfg.kernel_sizes)
        self.out_dim = cfg.num_filters * len(cfg.kernel_sizes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens).transpose(1, 2)  # (batch, embed, seq)
        lengths = (tokens != 0).sum(1, keepdim=True)
        pooled = []
        for conv in self.convs:
            out = torch.relu(conv(x))  # (batch, filters, seq - k + 1)
            # windows that start past the text's last full window see only padding: they must not win the max,
            # or a text's prediction would depend on how long the other texts of its batch are
            valid = torch.arange(out.size(2), device=tokens.device) < (lengths - conv.kernel_size[0] + 1).clamp(min=1)
            pooled.append(out.masked_fill(~valid.unsqueeze(1), 0.0).amax(dim=2))
        return torch.cat(pooled, dim=1)
