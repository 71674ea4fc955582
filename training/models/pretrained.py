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
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

from training.config import ConfigError, ModelConfig
from training.models.base import Family, TextEncoder, _keep, _top
from training.models.hub import PretrainedError, hub_reachable, not_a_checkpoint, offline, unavailable
from training.models.hub import check_source as check_hub_source

TOKENIZER_DIR = "tokenizer"  # in the prepared folder: the tokenizer the ids were made with
ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")  # positions start after the pad id


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' load reports and progress bars are for notebooks; zhflow says what it loaded itself."""
    from transformers.utils import logging as hf_logging

    import logging

    hub = logging.getLogger("huggingface_hub")
    verbosity, hub_level = hf_logging.get_verbosity(), hub.level
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hub.setLevel(logging.ERROR)  # its retry warnings: zhflow's own error says what went wrong
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
        hub.setLevel(hub_level)


def activation_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward pass (``train.gradient_checkpointing``), non-reentrant: it
    works under DDP and with inputs that need no gradient. transformers 5.x names it activation checkpointing (the
    old name warns)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _load(kind: str, source: str):
    """``transformers.<kind>.from_pretrained(source)``: a local folder or the cache first, the hub only if it answers."""
    import transformers

    cls = getattr(transformers, kind)
    with _quiet():
        try:
            return cls.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as err:
            if Path(source).expanduser().is_dir():
                reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
                raise not_a_checkpoint(Path(source).expanduser(), reason.rstrip(".")) from None
            if offline():
                raise unavailable(source, err) from None
        if (why := hub_reachable()) is not None:
            raise unavailable(source, OSError(why)) from None
        try:
            return cls.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise unavailable(source, err) from None


def load_tokenizer(source: str):
    return _load("AutoTokenizer", source)


def load_config(source: str):
    return _load("AutoConfig", source)


def check_source(source: str | None) -> None:
    """Fail fast (before any run is opened) when ``model.pretrained`` is missing or cannot be loaded: where it comes
    from (``training.models.hub``, without torch), then its config, loaded."""
    check_hub_source(source)
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
        with _quiet():  # texts longer than the model are cut below, and counted: not transformers' warning of it
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
    segments_words = False  # its tokenizer reads the cleaned text: no jieba at serving time
    serves_bf16 = True  # where the CPU has bf16 and the labels agree with fp32's (checked at registration)
    sweep_space = {  # fine-tuning: the settings that matter there (the checkpoint is the user's choice)
        "train.lr": {"low": 1e-5, "high": 1e-4, "log": True},
        "train.batch_size": {"choices": [16, 32]},
        "train.warmup_ratio": {"choices": [0.0, 0.06, 0.1]},
        "train.epochs": {"low": 2, "high": 5},
        "train.weight_decay": {"choices": [0.0, 0.01]},
    }

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
                if sizes.get("kept"):  # a structurally pruned checkpoint: its layers' shapes, before its weights load
                    shrink(model, [torch.arange(n) for n in sizes["kept"]["heads"]],
                           [torch.arange(n) for n in sizes["kept"]["units"]])
        return PretrainedClassifier(model)

    def checkpoint_sizes(self, state: dict) -> dict:
        return {k: v for k, v in state["sizes"].items() if k != "pretrained"}

    def collate(self, cfg: ModelConfig, sizes: dict):
        from functools import partial

        return partial(pad_tokens, pad_id=sizes["pad_id"])

    def structured_prune(self, model, cfg, amount, include_embedding, reference):
        """Attention heads and feed-forward units ranked by weight magnitude, the same share removed in every layer
        (of the checkpoint's own counts, which shrinking never changes: amounts stay cumulative); the embeddings stay."""
        import copy

        hf = model.model
        head_size = hf.config.hidden_size // hf.config.num_attention_heads
        n_heads, n_units = _keep(hf.config.num_attention_heads, amount), _keep(hf.config.intermediate_size, amount)
        keep_heads, keep_units = [], []
        for layer in _layers(hf):
            heads, units = head_and_unit_scores(layer, head_size)
            keep_heads.append(_top(heads, n_heads))
            keep_units.append(_top(units, n_units))
        pruned = copy.deepcopy(model)
        shrink(pruned.model, keep_heads, keep_units)
        return pruned, cfg

    def sizes_of(self, model, sizes: dict) -> dict:
        return sizes | {"kept": kept_sizes(model.model)}

    def enable_gradient_checkpointing(self, model, cfg) -> None:
        activation_checkpointing(model.model)

    def requirements(self) -> list[str]:
        return ["transformers", "tokenizers", "safetensors"]

    def export(self, model, out_dir, prepared_dir, labels):
        """A ``save_pretrained`` folder (safetensors weights, config with the label names, tokenizer) that
        ``AutoModelForSequenceClassification.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load. A model
        pruned structurally keeps its smaller feed-forward width (``intermediate_size``); the layout has no per-layer
        head count, so its removed heads are written as zeros (the same predictions; zhflow's own checkpoint and the
        served model are the physically smaller ones)."""
        import shutil

        hf = _full_layout(model.model)
        hf.config.id2label = dict(enumerate(labels))
        hf.config.label2id = {label: i for i, label in enumerate(labels)}
        out_dir = Path(out_dir)
        shutil.rmtree(out_dir, ignore_errors=True)
        with _quiet():
            hf.save_pretrained(out_dir)
        shutil.copytree(Path(prepared_dir) / TOKENIZER_DIR, out_dir, dirs_exist_ok=True)
        # the tokenizer's limit: the position table's, so that `tokenizer(text, truncation=True)` outside zhflow fits
        positions = hf.config.max_position_embeddings
        if getattr(hf.config, "model_type", "") in ROBERTA_LIKE:
            positions -= (hf.config.pad_token_id or 0) + 1
        settings = out_dir / "tokenizer_config.json"
        if settings.is_file():
            values = json.loads(settings.read_text(encoding="utf-8"))
            if not values.get("model_max_length") or values["model_max_length"] > positions:
                values["model_max_length"] = int(positions)
                settings.write_text(json.dumps(values, ensure_ascii=False, indent=2), encoding="utf-8")
        return str(out_dir)

    def served_artifacts(self, prepared_dir) -> dict[str, str]:
        return {"tokenizer": str(Path(prepared_dir) / TOKENIZER_DIR)}

    def text_encoder(self, cfg, sizes, artifacts, max_len, segmenter) -> TextEncoder:
        return TokenizerEncoder(artifacts["tokenizer"], sizes["pad_id"], sizes["max_len"])


class TokenizerEncoder(TextEncoder):
    """Cleaned texts -> the model's own token ids, cut as in preprocessing (the end token kept), padded."""

    def __init__(self, folder: str, pad_id: int, limit: int):
        self.tokenizer = load_tokenizer(folder)
        # cut here, counted in preprocessing: transformers' warning that a text is longer than the model (and "will
        # result in indexing errors") would be wrong, once per served model, in every predict and teacher's labelling
        self.tokenizer.model_max_length = int(1e30)
        self.pad_id, self.limit = pad_id, limit

    def __call__(self, clean, words=None):
        encoded = self.tokenizer(list(clean), truncation=False, add_special_tokens=True)["input_ids"]
        items = [({"tokens": torch.tensor(ids if len(ids) <= self.limit else ids[: self.limit - 1] + [ids[-1]])}, 0)
                 for ids in encoded]
        return pad_tokens(items, self.pad_id)[0]


# ---- structured pruning: attention heads and feed-forward units -------------------------------------------------

def _layers(hf: nn.Module) -> list:
    """The encoder layers of a BERT-like model (BERT, RoBERTa, MacBERT, ELECTRA, ERNIE share the layout)."""
    encoder = getattr(hf.base_model, "encoder", None)
    layers = getattr(encoder, "layer", None)
    if layers is None or not all(hasattr(l, "attention") and hasattr(l.attention, "self") and hasattr(l, "intermediate")
                                 for l in layers):
        raise ConfigError(f"prune.method: structured pruning knows the BERT layout (encoder.layer[i].attention.self, "
                          f".intermediate, .output); {type(hf).__name__} has another one; use global_unstructured")
    return list(layers)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.to(weight.dtype)


def _slice(module: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    w, b = module.weight.detach(), module.bias.detach() if module.bias is not None else None
    if rows is not None:
        w, b = w[rows], b[rows] if b is not None else None
    if cols is not None:
        w = w[:, cols]
    return _linear(w.clone(), b.clone() if b is not None else None)


def head_and_unit_scores(layer, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-magnitude importance: a head by the L2 norm of its query, key and value rows and its output columns; a
    feed-forward unit by the product of its input row's and output column's norms."""
    attn, out = layer.attention.self, layer.attention.output.dense
    qkv = torch.stack([attn.query.weight, attn.key.weight, attn.value.weight]).detach()  # (3, heads*size, hidden)
    heads = qkv.shape[1] // head_size
    head = (qkv.view(3, heads, head_size, -1).pow(2).sum((0, 2, 3))
            + out.weight.detach().view(-1, heads, head_size).pow(2).sum((0, 2))).sqrt()
    unit = layer.intermediate.dense.weight.detach().norm(dim=1) * layer.output.dense.weight.detach().norm(dim=0)
    return head, unit


def shrink(hf: nn.Module, keep_heads: list[torch.Tensor], keep_units: list[torch.Tensor]) -> None:
    """Physically remove heads and units (transformers 5 has no ``prune_heads``): the projections are sliced and the
    attention reads the number of heads from the width (``view(..., -1, head_size)``)."""
    head_size = hf.config.hidden_size // hf.config.num_attention_heads
    for layer, heads, units in zip(_layers(hf), keep_heads, keep_units):
        attn = layer.attention.self
        cols = (heads[:, None] * head_size + torch.arange(head_size)[None, :]).flatten()
        attn.query, attn.key, attn.value = (_slice(m, rows=cols) for m in (attn.query, attn.key, attn.value))
        attn.num_attention_heads, attn.all_head_size = len(heads), len(heads) * head_size
        layer.attention.output.dense = _slice(layer.attention.output.dense, cols=cols)
        layer.intermediate.dense = _slice(layer.intermediate.dense, rows=units)
        layer.output.dense = _slice(layer.output.dense, cols=units)


def kept_sizes(hf: nn.Module) -> dict:
    """Heads and feed-forward units of every layer now (saved with the checkpoint, so that it rebuilds)."""
    head_size = hf.config.hidden_size // hf.config.num_attention_heads
    layers = _layers(hf)
    return {"heads": [l.attention.self.query.out_features // head_size for l in layers],
            "units": [l.intermediate.dense.out_features for l in layers]}


def _full_layout(hf: nn.Module) -> nn.Module:
    """``hf`` in a layout its config describes: every head (removed ones as zeros, which add nothing: zero query and
    key rows give uniform attention over zero values, and zero output columns drop it), the widest feed-forward
    width of its layers (narrower ones padded with zero units)."""
    from transformers import AutoModelForSequenceClassification

    kept = kept_sizes(hf)
    if set(kept["heads"]) == {hf.config.num_attention_heads} and set(kept["units"]) == {hf.config.intermediate_size}:
        return hf
    import copy

    config = copy.deepcopy(hf.config)
    config.intermediate_size = max(kept["units"])
    with _quiet():
        full = AutoModelForSequenceClassification.from_config(config)
    source = hf.state_dict()
    state = {}
    for key, target in full.state_dict().items():
        value = source[key]
        if value.shape != target.shape:  # the kept heads / units first, zeros after
            padded = torch.zeros_like(target)
            padded[tuple(slice(0, n) for n in value.shape)] = value
            value = padded
        state[key] = value
    full.load_state_dict(state)
    return full
