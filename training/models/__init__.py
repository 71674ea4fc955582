"""Model families: one module each (``training.models.base.Family``), registered here with one line.

    from training.models import family_of
    family = family_of(cfg.model)                       # the settings' model.name
    model = family.build(cfg.model, family.sizes(manifest, cfg.model, max_len), num_classes)
    logits = model(batch)                               # a batch from family.collate(...)

    build_model(cfg.model, {"word": 20000, "char": 5000}, num_classes=2)  # a from-scratch family, by vocabulary sizes

This module imports no torch: the settings' schema reads the family names from it.
"""

from __future__ import annotations

import importlib
from functools import cache

# name -> "module:class"; adding a family is one module and one line here
REGISTRY = {
    "textcnn": "training.models.textcnn:TextCNN",
    "bilstm": "training.models.bilstm:BiLSTM",
    "transformer": "training.models.transformer:Transformer",
    "fasttext": "training.models.fasttext:FastText",
    "pretrained": "training.models.pretrained:Pretrained",
}
FAMILY_NAMES = tuple(REGISTRY)


@cache
def family(name: str):
    """The family registered as ``name``."""
    if name not in REGISTRY:
        raise ValueError(f"model.name: unknown model family {name!r}; choose one of {', '.join(REGISTRY)}")
    module, _, cls = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def family_of(cfg):
    """The family of a ModelConfig."""
    return family(cfg.name)


def model_inputs(cfg) -> tuple[str, ...]:
    return family_of(cfg).inputs(cfg)


def min_input_len(cfg) -> int:
    """Shortest token sequence the model accepts (the widest convolution of a TextCNN)."""
    return family_of(cfg).min_len(cfg)


def build_model(cfg, vocab_sizes: dict[str, int] | int, num_classes: int, max_len: int = 128):
    """A from-scratch family's model from its vocabulary sizes (word input cut at ``max_len``)."""
    if isinstance(vocab_sizes, int):
        vocab_sizes = {"word": vocab_sizes, "char": vocab_sizes}
    fam = family_of(cfg)
    return fam.build(cfg, {"vocab": vocab_sizes, "positions": fam.limits(cfg, max_len)}, num_classes)


def tokenizer_source(cfg) -> str | None:
    """The pretrained tokenizer a family reads its input with (None: zhflow's own vocabularies)."""
    return family_of(cfg).tokenizer_source(cfg)


def check_model(cfg) -> None:
    """The family's own check of the settings (a pretrained checkpoint that cannot be loaded), before any run opens."""
    family_of(cfg).check(cfg)


def tokenizer_key(source: str) -> str:
    """The digest of a pretrained tokenizer's files."""
    from training.models.pretrained import load_tokenizer, tokenizer_digest

    return tokenizer_digest(load_tokenizer(source))


def check_student(student, model) -> None:
    """A distilled student the run's prepared folder can feed: its own check, and for a pretrained student the same
    tokenizer as ``model`` (the folder holds one tokenizer's ids; a student with other ids would read garbage)."""
    check_model(student)
    theirs, ours = tokenizer_source(student), tokenizer_source(model)
    if theirs is not None and (ours is None or tokenizer_key(theirs) != tokenizer_key(ours)):
        from training.config import ConfigError

        raise ConfigError(f"distill.student.pretrained: {theirs!r} tokenizes with other ids than model.pretrained "
                          f"({ours!r}); a pretrained student needs the tokenizer of the run's model (same vocabulary), "
                          "or pick a family trained from scratch (textcnn, bilstm, transformer)")
