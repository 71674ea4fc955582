"""``--set section.key=value`` overrides, each value read by its field's own type.

    from training.overrides import apply_overrides
    from training.presets import preset
    cfg = apply_overrides(preset("tiny"), ["train.lr=3e-4", "model.dropout=0.2"])
"""

from __future__ import annotations

import json
from typing import Any, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError

from training.config import ConfigError, PipelineConfig, validate, validate_pretrain

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
    for attempt in (adapter.validate_json, adapter.validate_strings, lambda text: adapter.validate_python(_comma_list(text))):
        try:
            return attempt(raw)
        except ValidationError:
            continue
    if get_origin(annotation) is list:  # validation then names the element it refuses and what it takes
        try:
            return json.loads(raw)
        except ValueError:
            return _comma_list(raw)
    return raw


def _comma_list(text: str) -> list[str]:
    """``a,b`` or ``[a, b]`` (brackets without JSON's quotes, as people type them): the items, unquoted."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return [part.strip().strip("'\"") for part in text.split(",") if part.strip()]


def setting_field(key: str, given: str, root: type[BaseModel] = PipelineConfig) -> tuple[list[str], Any]:
    """The path and annotation of the field ``key`` names (``train.lr``, ``distill.student.name``), or ConfigError
    saying what there is."""
    parts = key.strip().split(".")
    top = root.model_fields.get(parts[0])
    if len(parts) == 1 and top is not None and not (isinstance(top.annotation, type) and issubclass(top.annotation, BaseModel)):
        return parts, top.annotation  # a setting outside the sections (pretraining's checkpoint_minutes)
    if len(parts) < 2:
        raise ConfigError(f"{given}: expected section.key=value, e.g. train.lr=3e-4")
    if parts[0] not in root.model_fields:
        raise ConfigError(f"unknown section {parts[0]!r} in {given} (not a setting); sections: {', '.join(root.model_fields)}")
    cls = root.model_fields[parts[0]].annotation
    for depth, name in enumerate(parts[1:], 1):
        where = ".".join(parts[:depth])
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            raise ConfigError(f"unknown field {key!r} in {given}: {where} is a value, not a section")
        if name not in cls.model_fields:
            raise ConfigError(f"unknown field {key!r} in {given}: {where} has no setting {name!r}; it has: {', '.join(cls.model_fields)}")
        cls = cls.model_fields[name].annotation
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        raise ConfigError(f"{given}: {key} is a section; set one of its fields: {', '.join(cls.model_fields)}")
    return parts, cls


def apply_settings(config: BaseModel, values: dict[str, Any]) -> BaseModel:
    """``{"train.lr": 3e-4, "distill.student.name": "bilstm", ...}`` (values as the fields take them) applied to
    ``config``, validated once."""
    data = config.model_dump()
    for key, value in values.items():
        parts, _ = setting_field(key, repr(key), type(config))
        node = data
        for name in parts[:-1]:
            node = node[name]
        node[parts[-1]] = value
    return validate(data) if isinstance(config, PipelineConfig) else validate_pretrain(data)


def apply_overrides(config: BaseModel, overrides: list[str]) -> BaseModel:
    """Apply ``section.key=value`` strings, each value read by its field's type; unknown keys and bad values raise
    ConfigError naming the field."""
    values = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
        key, raw = item.split("=", 1)
        parts, annotation = setting_field(key, f"--set {item!r}", type(config))
        values[".".join(parts)] = _parse_value(raw.strip(), annotation)
    return apply_settings(config, values)
