"""A small pre-norm Transformer encoder: learned or sinusoidal positions, padding mask, masked mean pooling.

Written out (rather than ``nn.TransformerEncoderLayer``) so that each layer can have its own number of
attention heads and feed-forward units: structured pruning removes whole heads and units and the
smaller layers load as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from training.config import ModelConfig
from training.models.base import SCRATCH_SWEEP_SPACE, ScratchFamily, _keep, _rows, _top, make_embedding


def sinusoidal(length: int, dim: int) -> torch.Tensor:
    position = torch.arange(length).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return table


class EncoderLayer(nn.Module):
    """x + attention(norm(x)), then x + feed-forward(norm(x)); 0 heads or 0 units drop that block."""

    def __init__(self, dim: int, heads: int, head_dim: int, ffn: int, dropout: float):
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, head_dim, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * heads * head_dim)  # rows: all q heads, then all k heads, then all v heads
        self.out = nn.Linear(heads * head_dim, dim)
        self.ff1, self.ff2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        if self.heads:
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attend[:, None, None, :],
                                               dropout_p=self.dropout if self.training else 0.0)
            x = x + self.drop(self.out(o.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)))
        if self.ff1.out_features:
            x = x + self.drop(self.ff2(self.drop(torch.relu(self.ff1(self.norm2(x))))))
        return x


class TransformerEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, max_positions: int):
        super().__init__()
        self.max_positions = max_positions  # the input's length limit: no position the model can never see
        self.checkpointing = False  # train.gradient_checkpointing
        self.embedding = make_embedding(vocab_size, cfg.embed_dim)
        if cfg.positions == "learned":
            self.positions = nn.Embedding(max_positions, cfg.embed_dim)
            nn.init.normal_(self.positions.weight, std=0.02)
        else:
            self.register_buffer("table", sinusoidal(max_positions, cfg.embed_dim), persistent=False)
            self.positions = None
        head_dim = cfg.head_dim or cfg.embed_dim // cfg.num_heads
        ffn = cfg.ffn_dim or 4 * cfg.embed_dim
        self.layers = nn.ModuleList(
            EncoderLayer(cfg.embed_dim, cfg.num_heads, head_dim, ffn, min(cfg.dropout, 0.1)) for _ in range(cfg.num_layers))
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
        for layer in self.layers:
            if self.checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, attend, use_reentrant=False)
            else:
                x = layer(x, attend)
        x = self.norm(x)
        weights = mask.unsqueeze(-1).float()
        return (x * weights).sum(1) / weights.sum(1).clamp(min=1)


class Transformer(ScratchFamily):
    name = "transformer"
    encoder = TransformerEncoder
    sweep_space = {  # every head count divides every width
        **SCRATCH_SWEEP_SPACE,
        "model.embed_dim": {"choices": [64, 128, 256]},
        "model.num_layers": {"choices": [1, 2, 4]},
        "model.num_heads": {"choices": [2, 4, 8]},
        "model.dropout": {"low": 0.0, "high": 0.3},
        "train.lr": {"low": 1e-4, "high": 1e-3, "log": True},
    }
    prunes_embedding_dims = False  # the residual width stays: heads and feed-forward units go

    def enable_gradient_checkpointing(self, model, cfg) -> None:
        for encoder in model.encoders.values():
            encoder.checkpointing = True

    def prune_encoder(self, sd, p, cfg, ref, amount, dims, new, update):
        """Attention heads ranked by the L2 norm of their q/k/v rows and output columns, feed-forward units by the
        product of their input and output norms."""
        hd = cfg.head_dim or cfg.embed_dim // cfg.num_heads
        ref_ffn = ref.ffn_dim or 4 * ref.embed_dim
        n_heads, n_ffn = _keep(ref.num_heads, amount), _keep(ref_ffn, amount)
        for layer in range(cfg.num_layers):
            q = f"{p}layers.{layer}."
            qkv, qkv_b, out = sd[q + "qkv.weight"], sd[q + "qkv.bias"], sd[q + "out.weight"]
            a = cfg.num_heads * hd
            head_score = (qkv.view(3, cfg.num_heads, hd, -1).pow(2).sum((0, 2, 3))
                          + out.view(-1, cfg.num_heads, hd).pow(2).sum((0, 2))).sqrt()
            heads = _top(head_score, n_heads)
            cols = (heads[:, None] * hd + torch.arange(hd)[None, :]).flatten()  # the kept heads' columns
            rows = _rows(cols, a, 3)
            new[q + "qkv.weight"], new[q + "qkv.bias"], new[q + "out.weight"] = qkv[rows], qkv_b[rows], out[:, cols]
            ff1, ff1_b, ff2 = sd[q + "ff1.weight"], sd[q + "ff1.bias"], sd[q + "ff2.weight"]
            units = _top(ff1.norm(dim=1) * ff2.norm(dim=0), n_ffn)
            new[q + "ff1.weight"], new[q + "ff1.bias"], new[q + "ff2.weight"] = ff1[units], ff1_b[units], ff2[:, units]
        update.update(num_heads=n_heads, head_dim=hd, ffn_dim=n_ffn)
        return torch.arange(cfg.embed_dim)
