"""fastText (Joulin et al., 2017): a bag of token n-grams, embedded and pooled, then a linear classifier.

Every token of the text (a jieba word or a character, by ``model.input``) and every run of 2 to ``model.ngrams`` tokens
is a feature. Tokens look their vector up in the vocabulary's embedding; longer n-grams are hashed from their token ids
into ``model.buckets`` rows of a second table, inside the model, so the served model needs nothing besides the
vocabularies the other families use. The text's vector is the sum of its features' vectors, each weighed by the
feature's inverse document frequency in the train split (``model.idf``; the weights are buffers fitted before training
and saved with the model), over the L2 norm of the weights (the sum's scale stays that of one feature whatever the
length, as a TF-IDF vector's does; with every weight 1, the square root of the number of features).
Both tables start at zero (the linear layer breaks the symmetry: each feature's gradient is that layer's weights
times the error): an n-gram or token no training text had keeps a zero vector instead of a random one, which on a
small dataset (300 texts of 60 classes, most test n-grams unseen) was 8 points of test macro-F1 in one
run each (0.525 with the layers' random start, 0.604). ``model.init=centroids`` starts them, and the linear layer,
as the nearest-centroid classifier of the train split instead (``centroid_init``): a start for few texts of many
classes, not the default (BENCHMARKS.md, default settings across datasets).
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
        self.sublinear, self.min_df = cfg.sublinear_tf, cfg.min_df
        self.embedding = make_embedding(vocab_size, cfg.embed_dim)
        self.ngrams = make_embedding(cfg.buckets + 1, cfg.embed_dim) if cfg.ngrams > 1 else None
        for table in (self.embedding, self.ngrams):
            if table is not None:
                table.sparse = True  # a batch touches a few thousand rows: sparse gradients (training.worker.make_optimizer)
                nn.init.zeros_(table.weight)  # a feature never seen in training adds nothing, as in TF-IDF (see below)
        # each feature's weight in the text's vector: 1 until fit_weights sets the train split's idf (saved with the
        # model, so evaluation and the served model weigh as training did); padding weighs 0
        self.register_buffer("token_weight", torch.ones(vocab_size))
        self.token_weight[0] = 0.0
        if self.ngrams is not None:
            self.register_buffer("ngram_weight", torch.ones(cfg.buckets + 1))
            self.ngram_weight[0] = 0.0
        self.out_dim = cfg.embed_dim

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("token_weight", "ngram_weight"):  # a checkpoint written before the weights: every feature weighs 1
            if hasattr(self, name) and prefix + name not in state_dict:
                state_dict[prefix + name] = getattr(self, name).new_ones(getattr(self, name).shape).index_fill_(0, torch.tensor([0]), 0.0)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def features(self, tokens: torch.Tensor):
        """(table, ids, weight table) of every order of feature of ``tokens``: the tokens, then each n-gram order."""
        yield self.embedding, tokens, self.token_weight
        for n in range(2, self.orders + 1):
            yield self.ngrams, ngram_ids(tokens, n, self.buckets), self.ngram_weight

    def weighted(self, tokens: torch.Tensor):
        """``([(table, ids, weights)] of every order of feature, squared norm)``: each occurrence's weight in the text's
        vector before the norm, and the square of that norm (batch,). Raw counts: a feature that occurs c times adds
        its weight c times, and the norm is over the occurrences' weights. ``model.sublinear_tf``: each occurrence
        weighs ``(1 + ln c) / c`` of the feature's weight (the feature adds ``1 + ln c`` times it, as TF-IDF's
        sublinear tf), and the norm is over the distinct features' weights (the TF-IDF vector's L2 norm)."""
        parts, norm = [], 0.0
        for table, ids, weight in self.features(tokens):
            w = weight[ids]  # padding weighs 0
            if self.sublinear:
                ranked = ids.sort(1).values
                c = (torch.searchsorted(ranked, ids, right=True) - torch.searchsorted(ranked, ids)).to(w.dtype)
                w = w * (1.0 + torch.log(c)) / c
                norm = norm + (w.square() * c).sum(1)  # each distinct feature once: (c w)^2 over its c occurrences
            else:
                norm = norm + w.square().sum(1)
            parts.append((table, ids, w))
        return parts, norm

    @torch.no_grad()
    def fit_weights(self, batches) -> None:
        """Each feature's inverse document frequency over the texts of ``batches`` (right-padded token ids), as
        scikit-learn's smoothed idf, ``ln((1 + n) / (1 + df)) + 1``; a feature no text had, or fewer than
        ``model.min_df``, weighs 0, as one outside a TF-IDF vocabulary (it stays out of the text's vector and norm)."""
        tables = {"token_weight": self.token_weight.numel()}
        if self.ngrams is not None:
            tables["ngram_weight"] = self.ngram_weight.numel()
        df = {name: torch.zeros(size, dtype=torch.float64) for name, size in tables.items()}
        texts = 0
        for tokens in batches:
            texts += tokens.size(0)
            rows = torch.arange(tokens.size(0)).unsqueeze(1)
            for (_, ids, weight), name in zip(self.features(tokens), ["token_weight"] + ["ngram_weight"] * (self.orders - 1)):
                size = tables[name]
                once = torch.unique((rows * size + ids).flatten()) % size  # each feature once per text
                df[name] += torch.bincount(once, minlength=size).double()
        for name, counts in df.items():
            idf = torch.log((1.0 + texts) / (1.0 + counts)) + 1.0
            idf[counts < self.min_df] = 0.0  # min_df is at least 1: a feature no text had weighs 0
            idf[0] = 0.0  # padding
            getattr(self, name).copy_(idf.to(getattr(self, name).dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        total = 0.0
        parts, norm = self.weighted(tokens)
        for table, ids, w in parts:
            total = total + torch.bmm(w.unsqueeze(1).to(table.weight.dtype), table(ids)).squeeze(1)
        return total / norm.clamp(min=1e-12).sqrt().unsqueeze(1).to(total.dtype)


CENTROID_SCALE = 10.0  # each factor's: the logits start at 100x the cosine of the text's vector and its class's mean


def _feature_rows(model: nn.Module, batches):
    """The train texts' feature vectors as the encoders see them (each input's weights over their L2 norm): one sparse
    matrix (texts x the input's token and n-gram rows) per input, and the labels; texts labelled below 0 left out."""
    import numpy as np
    import scipy.sparse as sp

    parts: dict[str, list] = {name: [] for name in model.encoders}
    labels_kept = []
    for batch, labels in batches:
        labels = torch.as_tensor(labels)
        keep = labels >= 0
        if not keep.any():
            continue
        labels_kept.append(labels[keep].numpy())
        for name, encoder in model.encoders.items():
            rows = encoder.embedding.num_embeddings  # the n-gram table's rows follow the tokens'
            size = rows + (encoder.ngrams.num_embeddings if encoder.ngrams is not None else 0)
            ids, weights = [], []
            occurrences, norm = encoder.weighted(batch[name][keep])
            for table, idx, weight in occurrences:
                ids.append(idx + (0 if table is encoder.embedding else rows))
                weights.append(weight.double())
            w = torch.cat(weights, 1) / norm.double().sqrt().clamp(min=1e-12).unsqueeze(1)
            n = w.size(0)
            part = sp.csr_matrix((w.flatten().numpy(), (np.repeat(np.arange(n), w.size(1)), torch.cat(ids, 1).flatten().numpy())),
                                 shape=(n, size))
            part.sum_duplicates()
            parts[name].append(part)
    if not labels_kept:
        return None, None
    return {name: sp.vstack(p, format="csr") for name, p in parts.items()}, np.concatenate(labels_kept)


@torch.no_grad()
def centroid_init(model: nn.Module, batches) -> None:
    """Start ``model`` (a TextClassifier of FastTextEncoders) as the nearest-centroid classifier of the train split.

    A text's vector is ``E^T x`` (x: its features' weights over their L2 norm, one vector per input, side by side
    before the classifier) and its logits ``W E^T x``. With M the classes' mean vectors x, each row scaled to unit
    length over all inputs, each input's block of M is factored as ``U S V^T`` (through the eigenvectors of
    ``M M^T``, classes x classes: M is never dense), its tables set to ``V S^1/2`` and its classifier columns to
    ``U S^1/2``, both times CENTROID_SCALE. The logits are then the centroid classifier's scores (the cosine of the
    text and each class's mean) exactly while the classes are at most ``model.embed_dim``, and their best
    rank-``embed_dim`` approximation beyond. Dimensions left over keep zero tables and the classifier's random start,
    as without. ``batches``: (token ids by input, labels); texts labelled below 0 (unlabelled) are left out."""
    import numpy as np
    import scipy.sparse as sp

    classes = model.classifier.out_features
    x, y = _feature_rows(model, batches)
    if x is None:
        return
    onehot = sp.csr_matrix((np.ones(len(y)), (y, np.arange(len(y)))), shape=(classes, len(y)))
    means = {name: sp.diags(1.0 / np.maximum(np.asarray(onehot.sum(1)).ravel(), 1)) @ onehot @ m for name, m in x.items()}
    norms = np.sqrt(sum(np.asarray(m.multiply(m).sum(1)).ravel() for m in means.values()))
    unit = sp.diags(1.0 / np.maximum(norms, 1e-12))
    weight, column = model.classifier.weight, 0
    for name, encoder in model.encoders.items():
        m = (unit @ means[name]).tocsr()
        values, vectors = np.linalg.eigh((m @ m.T).toarray())
        order = np.argsort(values)[::-1]
        k = min(encoder.out_dim, int((values > 1e-9 * max(values.max(), 1e-30)).sum()))
        s, u = np.sqrt(values[order[:k]]), vectors[:, order[:k]]
        tables = torch.from_numpy(np.asarray(m.T @ u) * (CENTROID_SCALE / np.sqrt(s))).to(weight.dtype)  # V S^1/2
        rows = encoder.embedding.num_embeddings
        encoder.embedding.weight[:, :k] = tables[:rows]
        encoder.embedding.weight[:, k:] = 0
        if encoder.ngrams is not None:
            encoder.ngrams.weight[:, :k] = tables[rows:]
            encoder.ngrams.weight[:, k:] = 0
        weight[:, column:column + k] = torch.from_numpy(u * np.sqrt(s) * CENTROID_SCALE).to(weight.dtype)
        column += encoder.out_dim
    model.classifier.bias.zero_()


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
        "model.idf": {"choices": [True, False]},
        "model.sublinear_tf": {"choices": [True, False]},
        "model.min_df": {"choices": [1, 2]},
        "model.init": {"choices": ["centroids", "zeros"]},
        "model.dropout": {"low": 0.0, "high": 0.5},
        "train.lr": {"low": 1e-3, "high": 2e-2, "log": True},
        "train.l2": {"choices": [0.0, 0.2, 1.0]},
        "train.batch_size": {"choices": [16, 32, 64]},
        "augment.enabled": {"choices": [False, True]},
        "prune.amount": {"choices": [0.0, 0.3, 0.5]},
    }

    def fit(self, model, cfg, train) -> None:
        """The inverse document frequency of every token and n-gram in the train split (``model.idf``). On 300 texts
        of 60 classes (law-names-300) macro-F1 on its validation and test texts together, 4 seeds: 0.671 against
        0.624 with every feature weighing 1; on the built-in corpus, 3 seeds: 0.8484 against 0.8472."""
        from torch.utils.data import DataLoader

        loader = DataLoader(train, batch_size=512, collate_fn=train.collate)
        if cfg.idf:
            for name, encoder in model.encoders.items():
                encoder.fit_weights(batch[name] for batch, _ in loader)
        if cfg.init == "centroids":
            centroid_init(model, loader)

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
