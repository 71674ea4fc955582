"""Training and fine-tuning tasks: both run the same DDP worker through torchrun."""

from __future__ import annotations

from pathlib import Path

import mlflow
from prefect import task

from training.config import PipelineConfig, TrainConfig, WorkerJob, flatten
from tasks.launch import launch_training, resolve_nproc
from tasks.tracking import stage_run


def _run_worker(stage: str, config: PipelineConfig, prepared: dict, parent: dict, **job_fields) -> dict:
    with stage_run(parent, stage) as run:
        train_cfg = job_fields.pop("train", config.train)
        nproc = resolve_nproc(train_cfg.nproc)
        job = WorkerJob(stage=stage, prepared_dir=prepared["path"], out_dir=str(Path(parent["work_dir"]) / stage),
                        model=config.model, train=train_cfg, max_len=config.preprocess.max_len,
                        mlflow_run_id=run.info.run_id, **job_fields)
        mlflow.log_params(flatten(config.model, "model.") | flatten(train_cfg, "train.") | {"nproc_resolved": nproc})
        result = launch_training(job)
        mlflow.log_artifact(result["best_checkpoint"], "checkpoint")
        mlflow.log_artifact(result["best_checkpoint"] + ".json", "checkpoint")
        mlflow.set_tags({"restarts": str(result["restarts"]), "stopped_early": str(result["stopped_early"]).lower(),
                         "torchrun": "nnodes={} nproc_per_node={}".format(train_cfg.nnodes, nproc)})
        return {**result, "run_id": run.info.run_id}


def with_limits(stage_task, train: TrainConfig):
    """The task with the run's timeout and retries (a retry resumes from the last checkpoint)."""
    return stage_task.with_options(
        timeout_seconds=train.timeout_minutes * 60 if train.timeout_minutes else None,
        retries=train.task_retries, retry_delay_seconds=5,
    )


@task(name="train")
def train_model(config: PipelineConfig, prepared: dict, parent: dict) -> dict:
    return _run_worker("train", config, prepared, parent)


@task(name="finetune")
def finetune_model(config: PipelineConfig, pruned: dict, prepared: dict, parent: dict) -> dict:
    """A short DDP fine-tune of the pruned weights; pruned weights stay zero."""
    p = config.prune
    if p.finetune_epochs == 0:
        with stage_run(parent, "finetune") as run:
            mlflow.set_tag("skipped", "prune.finetune_epochs=0")
            return {"best_checkpoint": pruned["checkpoint"], "run_id": run.info.run_id, "skipped": True}
    train_cfg = config.train.model_copy(update={"epochs": p.finetune_epochs, "lr": p.finetune_lr, "patience": p.finetune_epochs})
    return _run_worker("finetune", config, prepared, parent, train=train_cfg,
                       init_checkpoint=pruned["checkpoint"], keep_sparsity=True)
