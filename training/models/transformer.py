"""A small Transformer encoder: learned or sinusoidal positions, padding mask, masked mean pooling."""

from __future__ import annotations

import math

import torch
from torch import nn

from training.config import ModelConfig
from training.models.textcnn import make_embedding

MAX_POSITIONS = 8192
# the fused inference path reads attention weights directly and would skip pruning masks during fine-tuning
torch.backends.mha.set_fastpath_enabled(False)


def sinusoidal(length: int, dim: int) -> torch.Tensor:
    position = torch.arange(length).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return table


class TransformerEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.embedding = make_embedding(vocab_size, cfg.embed_dim)
        if cfg.positions == "learned":
            self.positions = nn.Embedding(MAX_POSITIONS, cfg.embed_dim)
            nn.init.normal_(self.positions.weight, std=0.02)
        else:
            self.register_buffer("table", sinusoidal(MAX_POSITIONS, cfg.embed_dim), persistent=False)
            self.positions = None
        layer = nn.TransformerEncoderLayer(cfg.embed_dim, cfg.num_heads, 4 * cfg.embed_dim, dropout=min(cfg.dropout, 0.1),
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.embed_dim)
        self.out_dim = cfg.embed_dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = tokens != 0
        idx = torch.arange(tokens.size(1), device=tokens.device)
        pos = self.positions(idx) if self.positions is not None else self.table[: tokens.size(1)]
        x = self.embedding(tokens) + pos
        # an all-padding row would make attention NaN: let it attend to its first position
        attend = mask.clone()
        attend[:, 0] |= ~mask.any(1)
        x = self.norm(self.encoder(x, src_key_padding_mask=~attend))
        weights = mask.unsqueeze(-1).float()
        return (x * weights).sum(1) / weights.sum(1).clamp(min=1)
