"""What a model family is, in one place: how its model is built from the settings and the prepared data, what input
it reads, how a batch is padded, how it is pruned structurally, what its checkpoint carries and what the served model
needs to encode raw text. The worker, evaluation, pruning, registration and the pyfunc go through this interface
(``training.models.family_of``) and never branch on a family's name.

The families trained from scratch (``textcnn``, ``bilstm``, ``transformer``) share :class:`ScratchFamily`: an
encoder over jieba word ids, character ids or both (two encoders, features concatenated), a dropout and a linear
classifier; their vocabularies put padding at id 0 (``training.data.vocab``). A family module subclasses it with its
encoder and the structured pruning of that encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch
from torch import nn

from training.config import ModelConfig
from training.data.dataset import pad_batch


class Family(ABC):
    """One model family. Subclasses set ``name`` and implement the abstract methods (a family missing one cannot be
    instantiated, so the registry refuses it at once); the others have defaults that suit most families."""

    name: ClassVar[str]
    sweep_space: ClassVar[dict | None] = None  # a sweep's built-in space from this family (None: training.sweep's)
    segments_words: ClassVar[bool] = True  # the served model segments with jieba (False: its own tokenizer only)
    serves_bf16: ClassVar[bool] = False  # the served model may run in bf16 (training.inference.serving_precision)
    # on a CPU machine, train in one process with every core's threads unless train.nproc says otherwise: a step is
    # too short for a second process to pay for the all-reduce (tasks.launch.resolve_nproc)
    one_process_on_cpu: ClassVar[bool] = False

    @abstractmethod
    def inputs(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The prepared inputs the model reads (names of ``training.data.dataset.FILES``)."""

    def check(self, cfg: ModelConfig) -> None:
        """Refuse settings the family cannot use, before any run is opened (a ``ConfigError`` naming the setting)."""

    def tokenizer_source(self, cfg: ModelConfig) -> str | None:
        """Where the family's own tokenizer comes from (preprocessing then stores its ids too); None: zhflow's own."""
        return None

    @abstractmethod
    def sizes(self, manifest: dict, cfg: ModelConfig, max_len: int) -> dict:
        """What ``build`` needs besides the settings, from the prepared data (stored in the checkpoint)."""

    @abstractmethod
    def build(self, cfg: ModelConfig, sizes: dict, num_classes: int) -> nn.Module:
        """A fresh model: ``model(batch) -> logits`` for a batch made by ``collate``."""

    @abstractmethod
    def limits(self, cfg: ModelConfig, max_len: int) -> dict[str, int]:
        """The longest sequence of each input the model reads (longer ones are cut)."""

    @abstractmethod
    def collate(self, cfg: ModelConfig, sizes: dict) -> Callable[[list], tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Items of an ``EncodedSplit`` -> one padded batch and its labels."""

    @abstractmethod
    def structured_prune(self, model: nn.Module, cfg: ModelConfig, amount: float, include_embedding: bool,
                         reference: ModelConfig) -> tuple[nn.Module, ModelConfig]:
        """A smaller model of the family, the ``amount`` share of ``reference``'s units removed (training.prune)."""

    def fit(self, model: nn.Module, cfg: ModelConfig, train) -> None:
        """Set what a fresh model learns from the train split before training (``train``: its ``EncodedSplit``)."""

    def sizes_of(self, model: nn.Module, sizes: dict) -> dict:
        """The sizes of ``model`` after structured pruning (saved with the pruned checkpoint); ``sizes``: before."""
        return sizes

    def checkpoint_sizes(self, state: dict) -> dict:
        """The sizes of a saved checkpoint (``build``'s argument), including checkpoints of earlier zhflow versions."""
        return state["sizes"]

    def enable_gradient_checkpointing(self, model: nn.Module, cfg: ModelConfig) -> None:
        """Recompute activations in the backward pass (``train.gradient_checkpointing``)."""
        from training.config import ConfigError

        raise ConfigError(f"train.gradient_checkpointing: the {self.name} family has no layers to checkpoint; it "
                          "saves memory for the pretrained and transformer families")

    def export(self, model: nn.Module, out_dir: Path, prepared_dir: str | Path, labels: list[str]) -> str | None:
        """Write the model in its family's standard layout, for use outside zhflow (None: the family has none)."""
        return None

    def requirements(self) -> list[str]:
        """Packages the served model needs beyond zhflow's own (pinned to the installed versions at registration)."""
        return []

    def served_artifacts(self, prepared_dir: str | Path) -> dict[str, str]:
        """Files of the prepared folder the served model needs to encode raw text (besides the checkpoint)."""
        return {}

    @abstractmethod
    def text_encoder(self, cfg: ModelConfig, sizes: dict, artifacts: dict[str, str], max_len: int, segmenter) -> "TextEncoder":
        """What turns cleaned texts into the model's batch at serving time."""


class TextEncoder(ABC):
    """Cleaned texts -> a batch for the model. ``needs_words``: it reads jieba words (passed in, segmented once)."""

    needs_words: bool = False

    @abstractmethod
    def __call__(self, clean: list[str], words: list[list[str]] | None = None) -> dict[str, torch.Tensor]:
        """The batch of ``clean`` (``words``: their jieba words, when the caller segmented them already)."""


# ---- the families trained from scratch ----------------------------------------------------------------------------

def make_embedding(vocab_size: int, dim: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab_size, dim, padding_idx=0)
    nn.init.normal_(embedding.weight, std=0.1)  # on the scale of the layers' weights, so global pruning is fair
    with torch.no_grad():
        embedding.weight[0].zero_()
    return embedding


def model_inputs(cfg: ModelConfig) -> tuple[str, ...]:
    return ("word", "char") if cfg.input == "both" else (cfg.input,)


class TextClassifier(nn.Module):
    """One encoder per input (words, characters), features concatenated, dropout, a linear layer."""

    def __init__(self, encoder: type[nn.Module], cfg: ModelConfig, vocab_sizes: dict[str, int], num_classes: int,
                 positions: dict[str, int]):
        super().__init__()
        self.inputs = model_inputs(cfg)
        self.encoders = nn.ModuleDict({name: encoder(cfg, vocab_sizes[name], positions[name]) for name in self.inputs})
        width = sum(enc.out_dim for enc in self.encoders.values())
        self.dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        features = [self.encoders[name](batch[name]) for name in self.inputs]
        return self.classifier(self.dropout(torch.cat(features, dim=1)))


def _keep(n_original: int, amount: float) -> int:
    return max(1, round(n_original * (1.0 - amount)))


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores (all of them if fewer), in their original order."""
    return torch.topk(scores, min(k, len(scores))).indices.sort().values


def _rows(idx: torch.Tensor, block: int, blocks: int) -> torch.Tensor:
    """Row indices of units ``idx`` in a matrix of ``blocks`` stacked blocks of ``block`` rows (LSTM gates, q/k/v)."""
    return torch.cat([idx + b * block for b in range(blocks)])


# what a sweep searches for every family trained from scratch on zhflow's vocabularies (each adds its own sizes). Not
# train.epochs: it is the maximum, and each trial trains until its validation score stops improving (the pruner ends
# the hopeless ones); a space that capped it would compare models stopped while still improving
SCRATCH_SWEEP_SPACE: dict[str, dict] = {
    "model.input": {"choices": ["word", "char", "both"]},
    "model.embed_dim": {"choices": [64, 128, 200]},
    "model.dropout": {"low": 0.1, "high": 0.6},
    "train.lr": {"low": 3e-4, "high": 5e-3, "log": True},
    "train.batch_size": {"choices": [32, 64, 128]},
    "augment.enabled": {"choices": [False, True]},
    "prune.amount": {"choices": [0.0, 0.3, 0.5]},
}


class ScratchFamily(Family):
    """A family trained from scratch on zhflow's own word / character vocabularies (padding id 0)."""

    encoder: ClassVar[type[nn.Module]]
    prunes_embedding_dims: ClassVar[bool] = True  # structured pruning also drops embedding dimensions

    def inputs(self, cfg: ModelConfig) -> tuple[str, ...]:
        return model_inputs(cfg)

    def min_len(self, cfg: ModelConfig) -> int:
        """Shortest token sequence the encoder accepts."""
        return 1

    def limits(self, cfg: ModelConfig, max_len: int) -> dict[str, int]:
        return {"word": max_len, "char": cfg.max_char_len}

    def sizes(self, manifest: dict, cfg: ModelConfig, max_len: int) -> dict:
        return {"vocab": {"word": manifest["vocab_size"], "char": manifest["char_vocab_size"]},
                "positions": self.limits(cfg, max_len)}

    def build(self, cfg: ModelConfig, sizes: dict, num_classes: int) -> nn.Module:
        return TextClassifier(self.encoder, cfg, sizes["vocab"], num_classes, sizes["positions"])

    def collate(self, cfg: ModelConfig, sizes: dict | None = None):
        from functools import partial

        return partial(pad_batch, min_len=self.min_len(cfg))

    def checkpoint_sizes(self, state: dict) -> dict:
        if "sizes" in state:
            return state["sizes"]
        # written before 0.4: vocabulary sizes only; the position table (if any) as long as it was saved
        rows = {name: state["model"][f"encoders.{name}.positions.weight"].shape[0]
                for name in ("word", "char") if f"encoders.{name}.positions.weight" in state["model"]}
        return {"vocab": state["vocab_sizes"], "positions": {"word": 8192, "char": 8192} | rows}

    @abstractmethod
    def prune_encoder(self, sd: dict, prefix: str, cfg: ModelConfig, ref: ModelConfig, amount: float,
                      dims: torch.Tensor, new: dict, update: dict) -> torch.Tensor:
        """Write the pruned encoder's tensors (under ``prefix``) into ``new`` and its new sizes into ``update``;
        ``dims``: the embedding dimensions kept. Returns the kept columns of its output features."""

    def structured_prune(self, model, cfg, amount, include_embedding, reference):
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        new: dict[str, torch.Tensor] = {}
        update: dict = {}
        classifier_cols, offset = [], 0
        for name, encoder in model.encoders.items():
            p = f"encoders.{name}."
            emb = sd[p + "embedding.weight"]
            dims = torch.arange(emb.size(1))
            if include_embedding and self.prunes_embedding_dims:
                dims = _top(emb.norm(dim=0), _keep(reference.embed_dim, amount))
                update["embed_dim"] = len(dims)
            new[p + "embedding.weight"] = emb[:, dims]
            kept = self.prune_encoder(sd, p, cfg, reference, amount, dims, new, update)
            classifier_cols.append(kept + offset)
            offset += encoder.out_dim
        new["classifier.weight"] = sd["classifier.weight"][:, torch.cat(classifier_cols)]
        new_cfg = cfg.model_copy(update=update)
        sizes = {"vocab": {name: enc.embedding.num_embeddings for name, enc in model.encoders.items()},
                 "positions": {name: enc.max_positions for name, enc in model.encoders.items()}}
        pruned = self.build(new_cfg, sizes, model.classifier.out_features)
        pruned.load_state_dict({k: new.get(k, v) for k, v in sd.items()})
        pruned.train(model.training)
        return pruned, new_cfg

    def served_artifacts(self, prepared_dir):
        return {"vocab": str(Path(prepared_dir) / "vocab.json"), "char_vocab": str(Path(prepared_dir) / "char_vocab.json")}

    def text_encoder(self, cfg, sizes, artifacts, max_len, segmenter):
        return VocabEncoder(self.inputs(cfg), artifacts, self.limits(cfg, max_len), self.min_len(cfg), segmenter)


class VocabEncoder(TextEncoder):
    """Words (jieba, as the prepared vocabulary holds them) and characters -> ids, right-padded with 0."""

    def __init__(self, inputs: tuple[str, ...], artifacts: dict[str, str], limits: dict[str, int], min_len: int, segmenter):
        from training.data.vocab import UNK
        from training.text.segment import Segmenter

        def stoi(path: str) -> dict[str, int]:
            return {tok: i for i, tok in enumerate(json.loads(Path(path).read_text(encoding="utf-8")))}

        self.inputs, self.limits, self.min_len, self.unk = inputs, limits, min_len, UNK
        self.stoi = {name: stoi(artifacts["vocab" if name == "word" else "char_vocab"]) for name in inputs}
        self.segmenter, self.chars = segmenter, Segmenter("char", "none")
        self.needs_words = "word" in inputs

    def __call__(self, clean, words=None):
        batch = {}
        for name in self.inputs:
            stoi, unk = self.stoi[name], self.stoi[name][self.unk]
            if name == "word":
                tokens = words if words is not None else [self.segmenter.tokenize(c) for c in clean]
            else:
                tokens = [self.chars.tokenize(c) for c in clean]
            rows = [[stoi.get(t, unk) for t in row][: self.limits[name]] for row in tokens]
            ids = torch.zeros(len(rows), max([self.min_len] + [len(r) for r in rows]), dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            batch[name] = ids
        return batch
