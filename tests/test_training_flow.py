"""The training task inside Prefect: the time budget stops training cleanly, a hung worker is ended by the timeout
and leaves nothing running, retries resume the same MLflow run."""

import subprocess

import pytest
from mlflow.tracking import MlflowClient
from prefect import flow

from tasks.preprocess import preprocess
from tasks.tracking import fail_open_runs, open_pipeline_run
from tasks.train import train_model, with_limits
from training.overrides import apply_overrides
from training.presets import tiny

pytestmark = pytest.mark.slow


def _config(small_csv, *overrides):
    return apply_overrides(tiny(), [f"data.dataset={small_csv}", "data.max_samples=null", "train.batch_size=8",
                                    "train.log_every=1", "train.nproc=2", *overrides])


@flow(on_failure=[fail_open_runs])
def train_only(cfg, experiment: str):
    parent = open_pipeline_run(cfg, experiment)
    prepared = preprocess(cfg.data, cfg.preprocess, cfg.augment, parent)
    return {"parent": parent, "trained": with_limits(train_model, cfg.train)(cfg, prepared, parent)}


def _alive(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def test_the_time_budget_ends_training_and_keeps_the_best_model(prefect_server, mlflow_store, small_csv, tmp_path):
    cfg = _config(small_csv, "train.epochs=1000", "train.patience=1000", "train.timeout_minutes=0.3")
    trained = train_only(cfg, "budget")["trained"]
    assert trained["stop_reason"] == "timeout" and 1 <= trained["epochs_run"] < 1000
    client = MlflowClient()
    run = client.get_run(trained["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["stop_reason"] == "timeout"
    assert len(client.get_metric_history(run.info.run_id, "val_macro_f1")) == trained["epochs_run"]
    assert not _alive(str(tmp_path / "zhflow-home" / "runs" / run.data.tags["mlflow.parentRunId"]))


def test_a_hung_worker_is_ended_by_the_timeout_and_the_mlflow_runs_fail(prefect_server, mlflow_store, small_csv, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("ZHFLOW_TEST_HANG_AT_STEP", "4")  # every rank stops answering in epoch 2 (3 steps an epoch)
    monkeypatch.setenv("ZHFLOW_TEST_TIMEOUT_GRACE_S", "15")  # ended 45 s after the start instead of 90
    cfg = _config(small_csv, "train.epochs=1000", "train.patience=1000", "train.timeout_minutes=0.5")
    with pytest.raises(Exception):
        train_only(cfg, "timeout")
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("timeout").experiment_id])
    train_run = [r for r in runs if r.data.tags.get("zhflow.stage") == "train"][0]
    assert client.get_metric_history(train_run.info.run_id, "val_macro_f1")  # it was really training
    status = {r.data.tags.get("zhflow.stage", "parent"): r.info.status for r in runs}
    assert status == {"parent": "FAILED", "preprocess": "FINISHED", "train": "FAILED"}  # nothing left RUNNING
    assert not _alive(str(tmp_path / "zhflow-home" / "runs" / train_run.data.tags["mlflow.parentRunId"]))


def test_task_retry_resumes_the_same_run_from_its_checkpoint(prefect_server, mlflow_store, small_csv, tmp_path, monkeypatch):
    monkeypatch.setenv("ZHFLOW_TEST_KILL_AT_STEP", "5")  # rank 1 dies in epoch 2; torchrun may not restart
    monkeypatch.setenv("ZHFLOW_TEST_KILL_ONCE_FILE", str(tmp_path / "killed"))
    cfg = _config(small_csv, "train.epochs=3", "train.patience=3", "train.max_restarts=0", "train.task_retries=1")
    result = train_only(cfg, "retry")
    assert (tmp_path / "killed").exists()
    trained = result["trained"]
    assert trained["resumed_after_epoch"] == 1 and trained["epochs_run"] == 3
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("retry").experiment_id],
                              "tags.`zhflow.stage` = 'train'")
    assert len(runs) == 1 and runs[0].info.run_id == trained["run_id"]  # one run, continued
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["zhflow.attempts"] == "2"
    steps = [m.step for m in client.get_metric_history(trained["run_id"], "val_macro_f1")]
    assert steps == [1, 2, 3]
