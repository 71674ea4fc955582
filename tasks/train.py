"""The training task, and the launcher that fine-tuning (tasks/prune.py) shares: the DDP worker under torchrun."""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlflow
from prefect import task

from training.config import PipelineConfig, TrainConfig, flatten
from training.job import WorkerJob
from training.models import family_of
from tasks.launch import launch_training, resolve_nproc, restart_tags
from tasks.tracking import stage_run


def launch_worker(stage: str, config: PipelineConfig, prepared: dict, run_id: str, out_dir: str | Path,
                  on_epoch=None, cpus: int | None = None, gpus: list[int] | None = None, **job_fields) -> dict:
    """Run the DDP worker for ``stage`` under torchrun; rank 0 logs into MLflow run ``run_id`` (the active one).

    ``on_epoch``, ``cpus``, ``gpus``: see tasks.launch.launch_training (a sweep's pruner, a parallel trial's share).
    """
    train_cfg = job_fields.pop("train", config.train)
    model_cfg = job_fields.pop("model", config.model)
    nproc = resolve_nproc(train_cfg.nproc, cpus, family_of(model_cfg))
    deadline = time.time() + train_cfg.timeout_minutes * 60 if train_cfg.timeout_minutes else None
    job = WorkerJob(stage=stage, prepared_dir=prepared["path"], out_dir=str(out_dir), model=model_cfg, train=train_cfg,
                    max_len=config.preprocess.max_len, mlflow_run_id=run_id, deadline=deadline, **job_fields)
    mlflow.log_params(flatten(model_cfg, "model.") | flatten(train_cfg, "train.") | {"nproc_resolved": nproc})
    result = launch_training(job, on_epoch=on_epoch, cpus=cpus, gpus=gpus)
    if result.get("stopped_by"):
        return {**result, "run_id": run_id}
    mlflow.log_artifact(result["best_checkpoint"], "checkpoint")
    mlflow.log_artifact(result["best_checkpoint"] + ".json", "checkpoint")
    if result.get("export_dir"):  # the family's own layout (save_pretrained), to load outside zhflow
        mlflow.log_artifacts(result["export_dir"], "export")
    mlflow.set_tags({**restart_tags(result), "stopped_early": str(result["stopped_early"]).lower(),
                     "stop_reason": result["stop_reason"], "still_improving": str(result["still_improving"]).lower(),
                     "torchrun": "nnodes={} nproc_per_node={}".format(train_cfg.nnodes, nproc)})
    return {**result, "run_id": run_id}


def hard_timeout(minutes: float | None) -> float | None:
    """When the task is ended: the worker stops by itself at the budget (between or inside epochs), so this only
    catches a worker that hangs; the grace leaves time for the last validation and checkpoint."""
    if not minutes:
        return None
    grace = os.environ.get("ZHFLOW_TEST_TIMEOUT_GRACE_S")  # test hook: a hung worker's test need not wait a minute
    return minutes * 60 + (float(grace) if grace else max(60.0, min(600.0, minutes * 12)))  # torchrun's start, end


def with_limits(stage_task, train: TrainConfig):
    """The task with the run's time budget and retries (a retry resumes from the last checkpoint)."""
    return stage_task.with_options(
        timeout_seconds=hard_timeout(train.timeout_minutes),
        retries=train.task_retries, retry_delay_seconds=5,
    )


@task(name="train")
def train_model(config: PipelineConfig, prepared: dict, parent: dict) -> dict:
    with stage_run(parent, "train") as run:
        return launch_worker("train", config, prepared, run.info.run_id, Path(parent["work_dir"]) / "train")
