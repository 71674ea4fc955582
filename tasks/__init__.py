"""Prefect tasks: thin wrappers around training/ that add caching, retries and MLflow runs."""

import os

# zhflow's MLflow settings, where the environment does not set them (tasks/tracking.py says why); here, so that the
# command line can set them before it validates anything, without importing MLflow and Prefect
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
                   "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "false"}


def apply_mlflow_defaults() -> None:
    """zhflow's MLflow settings (``MLFLOW_DEFAULTS``), where the environment does not set them."""
    for key, value in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(key, value)
