"""The worker under real torchrun: 2 processes on gloo, rank 0 logging into a real MLflow store."""

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from training.checkpoint import load_checkpoint
from training.config import WorkerJob, tiny
from training.data.prepare import prepare_dataset

pytestmark = pytest.mark.slow


@pytest.fixture
def prepared(tmp_path, small_csv):
    cfg = tiny()
    data = cfg.data.model_copy(update={"dataset": str(small_csv), "max_samples": None})
    prepare_dataset(data, cfg.preprocess, tmp_path / "prepared")
    return tmp_path / "prepared"


def _torchrun(job: WorkerJob, tmp_path, env_extra: dict) -> subprocess.CompletedProcess:
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "training.worker", "--config", str(job_file)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_two_process_ddp_run_logs_once_and_checkpoints(tmp_path, prepared, mlflow_store):
    client = MlflowClient()
    run = client.create_run(client.create_experiment("ddp"))
    cfg = tiny()
    job = WorkerJob(stage="train", prepared_dir=str(prepared), out_dir=str(tmp_path / "out"), model=cfg.model,
                    train=cfg.train.model_copy(update={"epochs": 3, "patience": 3, "log_every": 1, "batch_size": 8}), max_len=cfg.preprocess.max_len,
                    mlflow_run_id=run.info.run_id)
    out = _torchrun(job, tmp_path, {"MLFLOW_TRACKING_URI": mlflow_store})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 process(es) on cpu" in out.stdout

    import json

    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["world_size"] == 2 and result["epochs_run"] == 3
    state = load_checkpoint(result["best_checkpoint"])
    assert state["epoch"] == result["best_epoch"]

    history = client.get_metric_history(run.info.run_id, "val_macro_f1")
    assert [m.step for m in history] == [1, 2, 3]  # once per epoch: only rank 0 logged
    assert max(m.value for m in history) == pytest.approx(result["best_val_macro_f1"])
    losses = client.get_metric_history(run.info.run_id, "train_loss")
    steps = [m.step for m in losses]
    assert steps and len(steps) == len(set(steps))
    assert client.get_run(run.info.run_id).data.metrics["samples_per_second"] > 0


def test_worker_error_reaches_the_caller(tmp_path, prepared):
    cfg = tiny()
    job = WorkerJob(stage="train", prepared_dir=str(tmp_path / "missing"), out_dir=str(tmp_path / "out"),
                    model=cfg.model, train=cfg.train, max_len=64)
    out = _torchrun(job, tmp_path, {})
    assert out.returncode != 0
    assert "no manifest" in out.stdout + out.stderr
