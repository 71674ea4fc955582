"""TextCNN (Kim, 2014): embeddings -> parallel 1-D convolutions -> max over time."""

from __future__ import annotations

import torch
from torch import nn

from training.config import ModelConfig
from training.models.base import SCRATCH_SWEEP_SPACE, ScratchFamily, _keep, _top, make_embedding


class TextCNNEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, max_positions: int):
        super().__init__()
        self.max_positions = max_positions  # no position table: the limit only travels with the model
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


class TextCNN(ScratchFamily):
    name = "textcnn"
    encoder = TextCNNEncoder
    sweep_space = {**SCRATCH_SWEEP_SPACE, "model.num_filters": {"low": 50, "high": 200, "step": 50}}

    def min_len(self, cfg: ModelConfig) -> int:
        return max(cfg.kernel_sizes)  # the widest convolution

    def prune_encoder(self, sd, prefix, cfg, ref, amount, dims, new, update):
        """Filters ranked by L2 norm, the same share of every width kept."""
        n_keep, kept, offset = _keep(ref.num_filters, amount), [], 0
        for i in range(len(cfg.kernel_sizes)):
            w, b = sd[f"{prefix}convs.{i}.weight"][:, dims], sd[f"{prefix}convs.{i}.bias"]
            keep = _top(w.flatten(1).norm(dim=1), n_keep)
            new[f"{prefix}convs.{i}.weight"], new[f"{prefix}convs.{i}.bias"] = w[keep], b[keep]
            kept.append(keep + offset)
            offset += w.size(0)
        update["num_filters"] = n_keep
        return torch.cat(kept)
