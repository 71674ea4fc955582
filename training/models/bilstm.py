"""BiLSTM with attention pooling: a learned query scores every position; padding never counts."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from training.config import ModelConfig
from training.models.base import SCRATCH_SWEEP_SPACE, ScratchFamily, _keep, _rows, _top, make_embedding


class BiLSTMEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, max_positions: int):
        super().__init__()
        self.max_positions = max_positions  # no position table: the limit only travels with the model
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


class BiLSTM(ScratchFamily):
    name = "bilstm"
    encoder = BiLSTMEncoder
    sweep_space = {**SCRATCH_SWEEP_SPACE, "model.hidden_size": {"choices": [64, 128, 256]},
                   "model.dropout": {"low": 0.0, "high": 0.5}}

    def prune_encoder(self, sd, p, cfg, ref, amount, dims, new, update):
        """Hidden units ranked by the L2 norm of their four gates' rows, in both directions of every layer."""
        h, n_keep = cfg.hidden_size, _keep(ref.hidden_size, amount)
        inputs = dims  # input columns of layer 0: the kept embedding dimensions
        for layer in range(cfg.num_layers):
            kept = []
            for suffix, shift in (("", 0), ("_reverse", h)):
                k = f"{p}lstm.weight_ih_l{layer}{suffix}", f"{p}lstm.weight_hh_l{layer}{suffix}"
                kb = f"{p}lstm.bias_ih_l{layer}{suffix}", f"{p}lstm.bias_hh_l{layer}{suffix}"
                w_ih, w_hh = sd[k[0]], sd[k[1]]
                score = (w_ih.view(4, h, -1).pow(2).sum((0, 2)) + w_hh.view(4, h, -1).pow(2).sum((0, 2))).sqrt()
                units = _top(score, n_keep)
                rows = _rows(units, h, 4)
                new[k[0]], new[k[1]] = w_ih[rows][:, inputs], w_hh[rows][:, units]
                new[kb[0]], new[kb[1]] = sd[kb[0]][rows], sd[kb[1]][rows]
                kept.append(units + shift)
            inputs = torch.cat(kept)  # the next layer (and the attention) read both directions' outputs
        new[p + "attention.weight"], new[p + "attention.bias"] = sd[p + "attention.weight"][:, inputs], sd[p + "attention.bias"]
        update["hidden_size"] = n_keep
        return inputs
