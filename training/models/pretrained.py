"""The ``pretrained`` family: fine-tune a pretrained encoder (BERT, RoBERTa-wwm, MacBERT, RBT3, ...) with its own
tokenizer.

``model.pretrained`` is a local folder in the ``save_pretrained`` layout or a Hugging Face hub id; tokenizer and encoder
are loaded with transformers' Auto classes (``AutoModelForSequenceClassification`` puts a classification head on the
encoder). Preprocessing runs the tokenizer over the cleaned texts and stores the ids as flat arrays; the tokenizer
itself is saved in the prepared folder (``tokenizer/``) and travels with the served model, so serving needs neither
jieba nor the original checkpoint. Pad id, special tokens and the longest input come from the tokenizer and the model's
config, never assumed.

    zhflow run --model pretrained --pretrained ./my-bert          # a local folder
    zhflow run --preset finetune                                   # hfl/chinese-roberta-wwm-ext (a connected machine)
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

from training.config import ConfigError, ModelConfig
from training.models.base import Family, TextEncoder

TOKENIZER_DIR = "tokenizer"  # in the prepared folder: the tokenizer the ids were made with
ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")  # positions start after the pad id


class PretrainedError(ConfigError):
    """``model.pretrained`` cannot be loaded; the message says how to make it available."""


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' load reports and progress bars are for notebooks; zhflow says what it loaded itself."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _unavailable(source: str, err: Exception) -> PretrainedError:
    home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") else ""
    return PretrainedError(
        f"model.pretrained: {source!r} is not a local folder and not in the Hugging Face cache ({home}), and it could "
        f"not be downloaded{offline}: {reason}. Make it available: give a local folder in the save_pretrained layout "
        f"(config.json, weights, tokenizer files), point HF_HOME at a cache that holds it, or download it on a "
        f"connected machine (`hf download {source}`) and copy the folder or the cache here")


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        with _quiet():
            return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise _unavailable(source, err) from None


def load_config(source: str):
    from transformers import AutoConfig

    try:
        with _quiet():
            return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise _unavailable(source, err) from None


def check_source(source: str | None) -> None:
    """Fail fast (before any run is opened) when ``model.pretrained`` is missing or cannot be loaded."""
    if not source:
        raise PretrainedError("model.pretrained: the pretrained family needs a checkpoint: a local folder in the "
                              "save_pretrained layout or a hub id (--pretrained X)")
    folder = Path(source).expanduser()
    if not folder.is_dir() and (source.startswith((".", "/", "~")) or folder.exists()):
        raise PretrainedError(f"model.pretrained: {source!r}: no such folder (a local checkpoint is a folder in the "
                              "save_pretrained layout; anything else is taken as a hub id)")
    load_config(source)


def input_limit(config, tokenizer, max_len: int) -> int:
    """The longest input: ``preprocess.max_len``, the tokenizer's and the position table's limits, whichever is least."""
    positions = config.max_position_embeddings
    if getattr(config, "model_type", "") in ROBERTA_LIKE:
        positions -= (config.pad_token_id or 0) + 1
    limit = min(max_len, positions)
    if tokenizer.model_max_length and tokenizer.model_max_length < 1e9:
        limit = min(limit, tokenizer.model_max_length)
    return int(limit)


def tokenizer_digest(tokenizer) -> str:
    """A digest of the tokenizer's files as ``save_pretrained`` writes them: two tokenizers never share a folder."""
    import tempfile

    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def tokenize_splits(source: str, texts: dict[str, list[str]], max_len: int, out_dir: Path) -> dict:
    """Token ids of every split (``{split}.tokens_ids.npy`` / ``.tokens_offsets.npy``), the tokenizer saved beside them;
    the manifest's ``tokenizer`` entry (pad id, input limit, texts cut per split)."""
    tokenizer, config = load_tokenizer(source), load_config(source)
    if tokenizer.pad_token_id is None:
        raise PretrainedError(f"model.pretrained: {source!r}: its tokenizer has no padding token")
    limit = input_limit(config, tokenizer, max_len)
    truncated, lengths = {}, {}
    for split, rows in texts.items():
        encoded = tokenizer(rows, truncation=False, add_special_tokens=True)["input_ids"] if rows else []
        full = np.array([len(ids) for ids in encoded], dtype=np.int64)
        cut = [ids if len(ids) <= limit else ids[: limit - 1] + [ids[-1]] for ids in encoded]  # the end token stays
        offsets = np.zeros(len(cut) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(ids) for ids in cut])
        flat = np.fromiter((i for ids in cut for i in ids), dtype=np.int64, count=int(offsets[-1]))
        np.save(out_dir / f"{split}.tokens_ids.npy", flat)
        np.save(out_dir / f"{split}.tokens_offsets.npy", offsets)
        truncated[split] = int((full > limit).sum())
        lengths[split] = {f"p{q}": float(np.percentile(full, q)) for q in (50, 90, 99)} | {"max": int(full.max())} if len(full) else {}
    tokenizer.save_pretrained(out_dir / TOKENIZER_DIR)
    return {"source": source, "class": type(tokenizer).__name__, "digest": tokenizer_digest(tokenizer),
            "pad_id": int(tokenizer.pad_token_id), "vocab_size": len(tokenizer), "max_len": limit,
            "truncated": truncated, "token_length": lengths}


def pad_tokens(batch: list, pad_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-pad token ids with the tokenizer's pad id; the attention mask from the lengths (not from the ids)."""
    lengths = [len(item["tokens"]) for item, _ in batch]
    width = max([1] + lengths)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ((item, _), n) in enumerate(zip(batch, lengths)):
        ids[row, :n], mask[row, :n] = item["tokens"], 1
    labels = torch.tensor([label for _, label in batch], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask}, labels


class PretrainedClassifier(nn.Module):
    """``AutoModelForSequenceClassification`` behind zhflow's ``model(batch) -> logits``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


class Pretrained(Family):
    name = "pretrained"

    def inputs(self, cfg: ModelConfig) -> tuple[str, ...]:
        return ("tokens",)

    def limits(self, cfg: ModelConfig, max_len: int) -> dict[str, int]:
        return {"tokens": max_len}  # cut at tokenization, the end token kept: nothing is cut again

    def tokenizer_source(self, cfg: ModelConfig) -> str | None:
        return cfg.pretrained

    def check(self, cfg: ModelConfig) -> None:
        check_source(cfg.pretrained)

    def sizes(self, manifest: dict, cfg: ModelConfig, max_len: int) -> dict:
        if not manifest.get("tokenizer"):
            raise PretrainedError("the prepared dataset holds no token ids of a pretrained tokenizer; prepare it with "
                                  "model.name=pretrained")
        return {"pretrained": cfg.pretrained, "hf_config": load_config(cfg.pretrained).to_dict(),
                "pad_id": manifest["tokenizer"]["pad_id"], "max_len": manifest["tokenizer"]["max_len"]}

    def build(self, cfg: ModelConfig, sizes: dict, num_classes: int) -> nn.Module:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        with _quiet():
            if sizes.get("pretrained"):  # fine-tuning starts from the checkpoint's weights
                model = AutoModelForSequenceClassification.from_pretrained(sizes["pretrained"], num_labels=num_classes)
            else:  # a saved zhflow checkpoint: the architecture from the config it carries, the weights loaded after
                hf = dict(sizes["hf_config"])
                config = AutoConfig.for_model(hf.pop("model_type"), **(hf | {"num_labels": num_classes}))
                model = AutoModelForSequenceClassification.from_config(config)
        return PretrainedClassifier(model)

    def checkpoint_sizes(self, state: dict) -> dict:
        return {k: v for k, v in state["sizes"].items() if k != "pretrained"}

    def collate(self, cfg: ModelConfig, sizes: dict):
        from functools import partial

        return partial(pad_tokens, pad_id=sizes["pad_id"])

    def structured_prune(self, model, cfg, amount, include_embedding, reference):
        raise ConfigError("prune.method: structured pruning of the pretrained family is not available yet; use "
                          "global_unstructured or l1_unstructured")

    def enable_gradient_checkpointing(self, model, cfg) -> None:
        # non-reentrant: works under DDP and with inputs that need no gradient
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def requirements(self) -> list[str]:
        return ["transformers", "tokenizers", "safetensors"]

    def export(self, model, out_dir, prepared_dir, labels):
        """A ``save_pretrained`` folder (safetensors weights, config with the label names, tokenizer) that
        ``AutoModelForSequenceClassification.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load."""
        import shutil

        hf = model.model
        hf.config.id2label = dict(enumerate(labels))
        hf.config.label2id = {label: i for i, label in enumerate(labels)}
        out_dir = Path(out_dir)
        shutil.rmtree(out_dir, ignore_errors=True)
        with _quiet():
            hf.save_pretrained(out_dir)
        shutil.copytree(Path(prepared_dir) / TOKENIZER_DIR, out_dir, dirs_exist_ok=True)
        return str(out_dir)

    def served_artifacts(self, prepared_dir) -> dict[str, str]:
        return {"tokenizer": str(Path(prepared_dir) / TOKENIZER_DIR)}

    def text_encoder(self, cfg, sizes, artifacts, max_len, segmenter) -> TextEncoder:
        return TokenizerEncoder(artifacts["tokenizer"], sizes["pad_id"], sizes["max_len"])


class TokenizerEncoder(TextEncoder):
    """Cleaned texts -> the model's own token ids, cut as in preprocessing (the end token kept), padded."""

    def __init__(self, folder: str, pad_id: int, limit: int):
        self.tokenizer = load_tokenizer(folder)
        self.pad_id, self.limit = pad_id, limit

    def __call__(self, clean, words=None):
        encoded = self.tokenizer(list(clean), truncation=False, add_special_tokens=True)["input_ids"]
        items = [({"tokens": torch.tensor(ids if len(ids) <= self.limit else ids[: self.limit - 1] + [ids[-1]])}, 0)
                 for ids in encoded]
        return pad_tokens(items, self.pad_id)[0]
