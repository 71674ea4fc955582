"""BiLSTM with attention pooling: a learned query scores every position; padding never counts."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from training.config import ModelConfig
from training.models.textcnn import make_embedding


class BiLSTMEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.embedding = make_embedding(vocab_size, cfg.embed_dim)
        self.lstm = nn.LSTM(cfg.embed_dim, cfg.hidden_size, num_layers=cfg.num_layers, batch_first=True,
                            bidirectional=True, dropout=cfg.dropout if cfg.num_layers > 1 else 0.0)
        self.attention = nn.Linear(2 * cfg.hidden_size, 1)
        self.out_dim = 2 * cfg.hidden_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = tokens != 0
        lengths = mask.sum(1).clamp(min=1).cpu()  # an empty text still has one (padding) step
        packed = pack_padded_sequence(self.embedding(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.size(1))
        scores = self.attention(out).squeeze(-1).masked_fill(~mask, float("-inf"))
        scores = torch.where(mask.any(1, keepdim=True), scores, torch.zeros_like(scores))  # all-padding rows
        weights = torch.softmax(scores, dim=1).unsqueeze(-1)
        return (weights * out).sum(1)
