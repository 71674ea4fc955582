"""Sweep search spaces: which settings a sweep varies, and how Optuna samples them.

A space maps setting names (the same ``section.key`` names as ``--set`` and the MLflow params) to
either a list of choices or a numeric range:

    model.name: {choices: [textcnn, bilstm]}
    train.lr: {low: 3.0e-4, high: 3.0e-3, log: true}
    model.num_filters: {low: 50, high: 200, step: 50}

    from training.sweep import default_space, load_space, suggest, apply_params
    space = default_space(base_config)              # the family's own, or load_space("space.yaml")
    params = suggest(trial, space)                  # {"model.embed_dim": 64, "train.lr": 0.0011, ...}
    config = apply_params(base_config, params)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from training.config import ConfigError, PipelineConfig
from training.overrides import apply_settings, setting_field

# the settings every family has, for a family without a space of its own (each family module says what suits it:
# its sizes, its learning rates); a space that compares families names model.name itself
DEFAULT_SPACE: dict[str, dict] = {
    "model.dropout": {"low": 0.1, "high": 0.6},
    "train.lr": {"low": 3e-4, "high": 5e-3, "log": True},
    "train.batch_size": {"choices": [32, 64, 128]},
}


def default_space(config: PipelineConfig) -> dict[str, dict]:
    """The built-in space for the family the sweep starts from: its own (``Family.sweep_space``), or DEFAULT_SPACE."""
    from training.models import family_of

    return family_of(config.model).sweep_space or DEFAULT_SPACE


# a study's name: Prefect's concurrency limits (one per study) refuse these characters in their names
STUDY_NAME = r"^[^/%&><]*[^/%&><\s][^/%&><]*$"
STUDY_NAME_RULE = "needs a character other than a space, and none of / % & < >"


class SpaceError(ConfigError):
    """A search space that cannot be used; the message names the file and the setting."""


def _field(name: str, source: str = "search space"):
    """The annotation of the setting ``name`` (``train.lr``, ``distill.student.dropout``)."""
    try:
        return setting_field(name, repr(name))[1]
    except ConfigError as err:
        raise SpaceError(f"{source}: {err}; a search space names settings such as train.lr") from None


def check_space(space: dict[str, Any], source: str = "search space") -> dict[str, dict]:
    """The space, checked: known settings, non-empty choices, low < high; every value valid for its setting."""
    if not isinstance(space, dict) or not space:
        raise SpaceError(f"{source}: expected a mapping of settings to {{choices: [...]}} or {{low, high}}, got {space!r}")
    out = {}
    for name, spec in space.items():
        if not isinstance(name, str):
            raise SpaceError(f"{source}: {name!r}: setting names are text such as train.lr")
        _field(name, source)
        where = f"{source}: {name}"
        if isinstance(spec, list):
            spec = {"choices": spec}
        if not isinstance(spec, dict):
            raise SpaceError(f"{where}: expected {{choices: [...]}} or {{low: ..., high: ...}}, got {spec!r}")
        if "choices" in spec:
            if set(spec) != {"choices"} or not isinstance(spec["choices"], list) or not spec["choices"]:
                raise SpaceError(f"{where}: choices must be a non-empty list (and alone), got {spec!r}")
            samples = spec["choices"]
            if not all(v is None or isinstance(v, (str, int, float, bool)) for v in samples):
                raise SpaceError(f"{where}: choices must be plain values (text, numbers, true/false), got {samples!r}")
        else:
            unknown = set(spec) - {"low", "high", "log", "step"}
            if unknown or "low" not in spec or "high" not in spec:
                raise SpaceError(f"{where}: a range needs low and high (and optionally log or step), got {spec!r}")
            low, high = spec["low"], spec["high"]
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (low, high)) or not low < high:
                raise SpaceError(f"{where}: low must be a number below high, got low={low!r} high={high!r}")
            if spec.get("log") and low <= 0:
                raise SpaceError(f"{where}: a log range needs low > 0, got {low!r}")
            if "step" in spec and (spec.get("log") or not isinstance(spec["step"], (int, float)) or not spec["step"] > 0):
                raise SpaceError(f"{where}: step must be a positive number, and cannot go with log, got {spec!r}")
            samples = [low, high]
        for value in samples:  # the setting's own validation, naming the setting
            try:
                apply_params(PipelineConfig(), {name: value})
            except ConfigError as err:
                raise SpaceError(f"{where}: {value!r} is not a valid value: {err}") from None
        out[name] = spec
    return out


def load_space(path: str | Path) -> dict[str, dict]:
    """A space from a YAML or JSON file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise SpaceError(f"search space {str(path)!r}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:  # UnicodeDecodeError is a ValueError
        mark = getattr(err, "problem_mark", None)  # YAML: where the parser stopped, and why
        why = (f"line {mark.line + 1}, column {mark.column + 1}: {': '.join(filter(None, (err.context, err.problem)))}"
               if mark is not None else str(err))
        raise SpaceError(f"search space {path}: not valid UTF-8 {'JSON' if path.suffix == '.json' else 'YAML'}: {why}") from None
    if data is None:  # YAML of nothing but comments or blank lines
        raise SpaceError(f"search space {path}: the file names no setting (it is empty, or comments only)")
    return check_space(data, str(path))


def _is_int(name: str, spec: dict) -> bool:
    annotation = str(_field(name))
    return "int" in annotation and "float" not in annotation and all(isinstance(spec[k], int) for k in ("low", "high"))


def suggest(trial, space: dict[str, dict]) -> dict[str, Any]:
    """One value per setting from an Optuna trial."""
    params = {}
    for name, spec in space.items():
        if "choices" in spec:
            params[name] = trial.suggest_categorical(name, spec["choices"])
        elif _is_int(name, spec):
            params[name] = trial.suggest_int(name, spec["low"], spec["high"], step=spec.get("step", 1), log=spec.get("log", False))
        else:
            params[name] = trial.suggest_float(name, spec["low"], spec["high"], step=spec.get("step"), log=spec.get("log", False))
    return params


def grid(space: dict[str, dict]) -> dict[str, list]:
    """The grid for Optuna's GridSampler: choices as they are, integer ranges with a step expanded."""
    out = {}
    for name, spec in space.items():
        if "choices" in spec:
            out[name] = spec["choices"]
        elif _is_int(name, spec) and not spec.get("log"):
            out[name] = list(range(spec["low"], spec["high"] + 1, spec.get("step", 1)))
        elif spec.get("step"):
            n = int(round((spec["high"] - spec["low"]) / spec["step"]))
            out[name] = [spec["low"] + i * spec["step"] for i in range(n + 1)]
        else:
            raise SpaceError(f"{name}: the grid sampler needs choices or a range with a step, got {spec!r}")
    return out


def apply_params(config: PipelineConfig, params: dict[str, Any]) -> PipelineConfig:
    """``config`` with the trial's settings (validated; a bad combination raises ConfigError naming the field)."""
    return apply_settings(config, params)
