"""``zhflow deploy``: the zhflow deployments on a Prefect ``process`` work pool (created if missing).

    export PREFECT_API_URL=http://127.0.0.1:4200/api MLFLOW_TRACKING_URI=http://127.0.0.1:5000
    zhflow deploy                                  # pool "zhflow", runs in this folder
    prefect worker start --pool zhflow             # from this project's venv; runs what the schedules and the UI start

A process worker runs each flow run as ``python -m prefect.engine`` with its own Python, importing the flows from
the installed package (entrypoints by module path: no code storage to set up). The runs' working folder is the
folder ``zhflow deploy`` ran in, so ``.zhflow/`` and a local ``mlflow.db`` land in the same place as ``zhflow run``.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.workers.process import ProcessWorker

from deployments.definitions import for_work_pool

# what the runs need from the deploying shell; credentials are not among them (the worker's environment holds those)
FORWARDED = ("MLFLOW_TRACKING_URI", "ZHFLOW_HOME", "ZHFLOW_OPTUNA_STORAGE", "ZHFLOW_MLFLOW_UI_URL", "ZHFLOW_ALLOWED_PATHS")


def ensure_pool(name: str) -> bool:
    """Create process work pool ``name`` unless it exists; True if it was created. Another type of pool is refused."""
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=name, type="process", base_job_template=ProcessWorker.get_default_base_job_template(),
                description="zhflow: flow runs as local processes of a `prefect worker start --pool` worker"))
            return True
    if pool.type != "process":
        raise ValueError(f"work pool {name!r} is of type {pool.type!r}; zhflow deploy needs a process pool (choose "
                         f"another --pool name, or deploy with prefect.yaml for {pool.type} pools)")
    return False


def job_variables(workdir: Path) -> dict:
    env = {}
    for key in FORWARDED:
        if value := os.environ.get(key):
            if "://" in value and urlsplit(value).password:
                raise ValueError(f"{key} holds a password; keep it out of the deployment: give the worker "
                                 "MLFLOW_TRACKING_USERNAME/PASSWORD or PGPASSWORD (or ~/.pgpass) instead")
            env[key] = value
    return {"working_dir": str(workdir.resolve()), "env": env}


def deploy(pool: str = "zhflow", workdir: Path | None = None) -> tuple[list[UUID], bool]:
    """Create the pool if missing and create or update every zhflow deployment on it."""
    created = ensure_pool(pool)
    ids = [d.apply(work_pool_name=pool) for d in for_work_pool(pool, job_variables(workdir or Path.cwd()))]
    return ids, created
