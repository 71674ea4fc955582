"""fastText (Joulin et al., 2017): a bag of token n-grams, embedded and pooled, then a linear classifier.

Every token of the text (a jieba word or a character, by ``model.input``) and every run of 2 to ``model.ngrams`` tokens
is a feature. Tokens look their vector up in the vocabulary's embedding; longer n-grams are hashed from their token ids
into ``model.buckets`` rows of a second table, inside the model, so the served model needs nothing besides the
vocabularies the other families use. The text's vector is the sum of its features' vectors over the square root of
their number (the sum's scale stays that of one feature whatever the length, as an L2-normalised bag of counts does).
Both tables start at zero (the linear layer breaks the symmetry: each feature's gradient is that layer's weights
times the error): an n-gram or token no training text had keeps a zero vector instead of a random one, which on a
small dataset (300 texts of 60 classes, most test n-grams unseen) was 8 points of test macro-F1 in one
run each (0.525 with the layers' random start, 0.604).
It reads n-grams the way TF-IDF + linear models do, which is why it holds up on datasets where the convolutional and
recurrent families need more data. Both tables have sparse gradients: a step (and the exchange between processes, on gloo) costs
the rows the batch touched, not ``model.buckets`` x ``model.embed_dim``; on CUDA (nccl has no sparse all-reduce), under
pruning masks and under torch.compile the worker makes them dense.
"""

from __future__ import annotations

import torch
from torch import nn

from training.config import ModelConfig
from training.models.base import ScratchFamily, _keep, _top, make_embedding

PRIME = 1_000_003  # the n-gram hash: ((n * P + t0) * P + t1) * P + ... modulo the buckets


def ngram_ids(tokens: torch.Tensor, n: int, buckets: int) -> torch.Tensor:
    """Row ids (1..buckets) of the n-grams of right-padded ``tokens`` (batch, length); 0 where an n-gram runs into
    padding. Deterministic integer arithmetic: the same ids on every machine and torch version."""
    span = tokens.size(1) - n + 1
    if span < 1:
        return tokens.new_zeros(tokens.size(0), 0)
    h = torch.full_like(tokens[:, :span], n)
    for j in range(n):
        h = (h * PRIME + tokens[:, j:j + span]) % buckets  # every step stays below 2**45: no int64 overflow
    return torch.where(tokens[:, n - 1:] != 0, h + 1, torch.zeros_like(h))  # right padding: the last token decides


class FastTextEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, max_positions: int):
        super().__init__()
        self.max_positions = max_positions  # no position table: the limit only travels with the model
        self.orders, self.buckets = cfg.ngrams, cfg.buckets
        self.embedding = make_embedding(vocab_size, cfg.embed_dim)
        self.ngrams = make_embedding(cfg.buckets + 1, cfg.embed_dim) if cfg.ngrams > 1 else None
        for table in (self.embedding, self.ngrams):
            if table is not None:
                table.sparse = True  # a batch touches a few thousand rows: sparse gradients (training.worker.make_optimizer)
                nn.init.zeros_(table.weight)  # a feature never seen in training adds nothing, as in TF-IDF (see below)
        self.out_dim = cfg.embed_dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        total = self.embedding(tokens).sum(1)  # padding's row is zero and never trained
        count = (tokens != 0).sum(1)
        for n in range(2, self.orders + 1):
            ids = ngram_ids(tokens, n, self.buckets)
            total = total + self.ngrams(ids).sum(1)
            count = count + (ids != 0).sum(1)
        return total / count.clamp(min=1).unsqueeze(1).to(total.dtype).sqrt()


class FastText(ScratchFamily):
    name = "fasttext"
    # a step of 32 texts lasts about 10 ms on one thread; the exchange of its touched rows on gloo about as long:
    # 2 processes of 1 thread trained 0.70x as fast as 1 process of 2 (BENCHMARKS.md, training throughput)
    one_process_on_cpu = True
    encoder = FastTextEncoder
    sweep_space = {  # its own sizes; a sweep from the default preset searches fastText, not the other families
        "model.input": {"choices": ["word", "char", "both"]},
        "model.embed_dim": {"choices": [16, 32, 64]},
        "model.ngrams": {"choices": [2, 3, 4]},
        "model.dropout": {"low": 0.0, "high": 0.5},
        "train.lr": {"low": 1e-3, "high": 2e-2, "log": True},
        "train.batch_size": {"choices": [16, 32, 64]},
        "augment.enabled": {"choices": [False, True]},
        "prune.amount": {"choices": [0.0, 0.3, 0.5]},
    }

    def check(self, cfg: ModelConfig) -> None:
        from training.config import ConfigError

        if cfg.ngrams > 1 and (cfg.buckets + 1) * cfg.embed_dim > 2**31:
            raise ConfigError(f"model.buckets: {cfg.buckets} buckets of {cfg.embed_dim} values is a table of over 2**31 "
                              "numbers; use fewer buckets or a smaller model.embed_dim")

    def prune_encoder(self, sd, prefix, cfg, ref, amount, dims, new, update):
        """The embedding dimensions are the model's only units: ranked by the L2 norm of their column over both
        tables (tokens and n-grams), the same number kept for every input, whatever ``prune.include_embedding``."""
        tables = [f"{prefix}embedding.weight"] + ([f"{prefix}ngrams.weight"] if f"{prefix}ngrams.weight" in sd else [])
        norms = torch.cat([sd[k] for k in tables]).norm(dim=0)
        dims = _top(norms, _keep(ref.embed_dim, amount))
        for k in tables:
            new[k] = sd[k][:, dims]
        update["embed_dim"] = len(dims)
        return dims
