"""``--set section.key=value`` overrides, each value read by its field's own type.

    from training.overrides import apply_overrides
    from training.presets import preset
    cfg = apply_overrides(preset("tiny"), ["train.lr=3e-4", "model.dropout=0.2"])
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from training.config import ConfigError, PipelineConfig, validate

def _parse_value(raw: str, annotation: Any) -> Any:
    """A --set value read by the field's own type: JSON (``3e-4``, ``[3, 4]``, ``null``), else the text as that type
    reads it (``word``, ``true``, a path), else a comma list (``kernel_sizes=3,4,5``). A value none of them takes is
    passed on as text, and validation names the field."""
    adapter = TypeAdapter(annotation)
    if raw in ("", "null"):
        try:
            return adapter.validate_python(None)
        except ValidationError:
            pass
    for attempt in (adapter.validate_json, adapter.validate_strings,
                    lambda text: adapter.validate_python([part.strip() for part in text.split(",") if part.strip()])):
        try:
            return attempt(raw)
        except ValidationError:
            continue
    return raw


def _field(key: str, given: str):
    """The (section, field, annotation) ``key`` names (``train.lr``), or ConfigError saying what there is."""
    parts = key.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"{given}: expected section.key=value, e.g. train.lr=3e-4")
    section, field = parts
    if section not in PipelineConfig.model_fields:
        raise ConfigError(f"unknown section {section!r} in {given}; sections: {', '.join(PipelineConfig.model_fields)}")
    section_cls = PipelineConfig.model_fields[section].annotation
    if field not in section_cls.model_fields:
        raise ConfigError(f"unknown field {key!r} in {given}; {section} has: {', '.join(section_cls.model_fields)}")
    return section, field, section_cls.model_fields[field].annotation


def apply_settings(config: PipelineConfig, values: dict[str, Any]) -> PipelineConfig:
    """``{"train.lr": 3e-4, ...}`` (values as the fields take them) applied to ``config``, validated once."""
    data = config.model_dump()
    for key, value in values.items():
        section, field, _ = _field(key, repr(key))
        data[section][field] = value
    return validate(data)


def apply_overrides(config: PipelineConfig, overrides: list[str]) -> PipelineConfig:
    """Apply ``section.key=value`` strings, each value read by its field's type; unknown keys and bad values raise
    ConfigError naming the field."""
    values = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
        key, raw = item.split("=", 1)
        section, field, annotation = _field(key, f"--set {item!r}")
        values[f"{section}.{field}"] = _parse_value(raw.strip(), annotation)
    return apply_settings(config, values)
