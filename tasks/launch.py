"""The torchrun launcher: builds the command, streams the workers' output into
the Prefect log as it comes, follows the worker's events (training.events:
progress into a Prefect progress artifact, each epoch to a sweep's pruner, the
result), and always leaves no process behind.

One machine:   torchrun --standalone --nproc-per-node N --max-restarts R -m training.worker --config job.json
Several:       torchrun --nnodes M --node-rank K --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID \
                        --nproc-per-node N --max-restarts R -m training.worker --config job.json
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
import torch
from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.recover import OWNER_ENV, owner
from training.config import TrainConfig
from training.distributed import torchrun_env
from training.events import EVENTS_FILE, EventReader
from training.job import PretrainJob, WorkerJob
from training.models import family_of
from training.models.base import Family

POLL_SECONDS = 0.2  # how often the events file is read while the workers run
# set when a sweep is interrupted (Ctrl-C, SIGTERM: tasks/sweep.py optimize): each launcher ends its workers and
# raises KeyboardInterrupt within POLL_SECONDS, in whichever thread it runs (parallel trials run in Optuna's threads)
STOPPING = threading.Event()
_ERROR_LINE = re.compile(r"^\s*(\w+\.)*\w*(Error|Exception|Interrupt)\b.*")
_FAILED_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")  # torchrun, as a worker group fails


class TrainingFailed(RuntimeError):
    pass


def available_devices() -> tuple[str, int]:
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    return "cpu", os.cpu_count() or 1


def resolve_nproc(requested: int | None, cores: int | None = None, family: Family | None = None) -> int:
    """Default: one process per GPU; on a CPU machine one per core of the job's share (``cores``, all by default),
    or one with every core's threads for a family whose steps are too short for DDP to pay
    (``Family.one_process_on_cpu``: fastText)."""
    kind, count = available_devices()
    if requested is None:
        if kind == "cuda":
            return count
        return 1 if family is not None and family.one_process_on_cpu else max(1, min(cores or count, count))
    if kind == "cuda" and requested > count:
        raise ValueError(f"train.nproc={requested} but this machine has {count} GPU(s)")
    if kind == "cpu" and requested > count:  # more processes than cores only slows every one of them down
        raise ValueError(f"train.nproc={requested} but this machine has {count} CPU core(s): give at most {count}")
    return requested


def torchrun_command(job_file: Path, nproc: int | str, train: TrainConfig, rdzv_id: str,
                     module: str = "training.worker") -> list[str]:
    """One machine: --standalone (a free local port, so parallel runs never collide).
    Several: the c10d rendezvous at train.rdzv_endpoint, shared by every node under one job id."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if train.nnodes == 1:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(train.nnodes), "--node-rank", str(train.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", str(train.rdzv_endpoint), "--rdzv-id", train.rdzv_id or rdzv_id]
    return cmd + ["--nproc-per-node", str(nproc), "--max-restarts", str(train.max_restarts),
                  "-m", module, "--config", str(job_file)]


def _root_cause(error_file: Path) -> str | None:
    """torchelastic's error file (written through @record) holds the failing rank's exception."""
    try:
        message = json.loads(error_file.read_text())["message"]
    except (OSError, ValueError, KeyError):
        return None
    return message.get("message") if isinstance(message, dict) else str(message)


def _error_summary(tail: list[str]) -> str:
    errors = [line.strip() for line in tail if _ERROR_LINE.match(line)]
    return errors[-1] if errors else (tail[-1].strip() if tail else "no output")


def _failure(line: str, before: Iterable[str]) -> str | None:
    """What a line of torchrun's output says of a failed worker group, with the first error the workers printed
    ``before`` it (the failing rank prints first; its peers' errors follow): None for any other line."""
    match = _FAILED_LINE.search(line)
    if not match:
        return None
    code, local_rank = int(match.group(1)), match.group(2)
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    except ValueError:
        how = f"exited with code {code}"
    errors = [b.strip() for b in before if _ERROR_LINE.match(b)]
    return f"local rank {local_rank} {how}" + (f": {errors[0]}" if errors else "")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    # torchrun gives its workers 30 s to stop after SIGTERM before it kills them: wait longer than that
    for sig, wait in ((signal.SIGTERM, 40), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _log_unsent(run_id: str | None, history: dict[int, dict]) -> None:
    """The epochs a stopped worker had run but not sent: their metrics, logged as it would have. It sends them with
    the checkpoint that holds them (so that a restart never logs an epoch twice), and at its end; what the run holds
    is read back after the worker has ended, so an epoch sent just before the stop is not logged twice."""
    if not run_id or not history:
        return
    client = MlflowClient()
    sent = {m.step for m in client.get_metric_history(run_id, "val_macro_f1")}
    metrics = [Metric(key, float(value), int(time.time() * 1000), epoch) for epoch, h in sorted(history.items())
               if epoch not in sent for key, value in h.items() if key != "sent" and isinstance(value, (int, float))]
    if metrics:
        client.log_batch(run_id, metrics=metrics)


def launch_training(job: WorkerJob | PretrainJob, on_epoch: Callable[[int, dict], bool] | None = None, cpus: int | None = None,
                    gpus: list[int] | None = None, module: str = "training.worker") -> dict:
    """Run the worker under torchrun and return the result it reports; a failure raises with the worker's error.

    ``on_epoch(epoch, metrics)`` sees each epoch's validation metrics as they come; when it returns True the
    whole process group is ended and ``{"stopped_by": "on_epoch", ...}`` returned (a sweep's pruner).
    ``cpus``: the CPU cores this job may use (default all), shared out as threads among its processes;
    ``gpus``: the GPUs it may use (CUDA_VISIBLE_DEVICES; default all); ``module``: the worker (``training.mlm`` for a
    PretrainJob).
    """
    logger = get_run_logger()
    family = family_of(job.model) if isinstance(job, WorkerJob) else None
    nproc = resolve_nproc(job.train.nproc, cpus, family)
    if job.train.nproc is None and family is not None and family.one_process_on_cpu and available_devices()[0] == "cpu":
        logger.info("%s trains in one process with every core's threads on a CPU machine: its steps are too short for "
                    "DDP's all-reduce to pay (train.nproc sets more processes)", family.name)
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    job_file = out_dir / "job.json"
    job_file.write_text(job.model_dump_json(indent=2))
    error_file, events_file = out_dir / "error.json", out_dir / EVENTS_FILE
    error_file.unlink(missing_ok=True)
    events_file.unlink(missing_ok=True)  # a retry of the task starts a new stream (the worker resumes from last.pt)
    cmd = torchrun_command(job_file, nproc, job.train,
                           rdzv_id=job.mlflow_run_id or out_dir.name, module=module)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MLFLOW_TRACKING_URI=mlflow.get_tracking_uri(),
               TORCHELASTIC_ERROR_FILE=str(error_file), **torchrun_env(job.train.nnodes), **{OWNER_ENV: owner()})  # found again if this process is killed
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    if available_devices()[0] == "cpu":  # the processes' share of the cores; torch reads it as it starts
        env["OMP_NUM_THREADS"] = str(max(1, (cpus or os.cpu_count() or 1) // nproc))
    logger.info("launching: %s", " ".join(cmd))
    artifact = create_progress_artifact(progress=0.0, key=f"{job.stage.replace('_', '-')}-progress", description=f"{job.stage}: epochs done")
    tail: collections.deque[str] = collections.deque(maxlen=200)
    events = EventReader(events_file)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=env, start_new_session=True)
    # the output for people goes to the Prefect log as it comes; what the launcher acts on comes as events
    failures: list[str] = []  # each time the worker group failed, as torchrun said and the workers printed it
    echo = threading.Thread(target=_echo, args=(proc, logger, tail, failures), daemon=True, name=f"{job.stage}-output")
    echo.start()
    history: dict[int, dict] = {}  # by epoch: an elastic restart repeats the epochs after its checkpoint
    result, stopped_at = None, None
    try:
        while True:
            running = proc.poll() is None
            for event in events.read():
                kind = event.pop("event")
                if kind == "progress":
                    done = (event["epoch"] - 1 + event["fraction"]) / event["epochs"]
                    update_progress_artifact(artifact, progress=round(100 * done, 1))
                elif kind == "epoch":
                    history[event["epoch"]] = event
                    if stopped_at is None and on_epoch is not None and on_epoch(event["epoch"], event):
                        logger.info("%s: stopped after epoch %d (pruned by the sweep)", job.stage, event["epoch"])
                        stopped_at = event["epoch"]
                        _stop(proc)  # the next pass still reads what it wrote before it ended
                elif kind == "result":
                    result = event
            if STOPPING.is_set():  # before the exit is read: a signal to the whole group may have ended torchrun too
                raise KeyboardInterrupt(f"{job.stage}: interrupted")
            if not running:
                break
            time.sleep(POLL_SECONDS)
        if stopped_at is not None:
            _log_unsent(job.mlflow_run_id, history)
            best = max(h["val_macro_f1"] for h in history.values())
            return {"stopped_by": "on_epoch", "stopped_at": stopped_at, "epochs_run": max(history),
                    "best_val_macro_f1": best, "history": [history[e] for e in sorted(history)]}
        rc = proc.wait()
    finally:
        _stop(proc)  # also on cancellation or an exception in this process: no orphaned workers
        echo.join(timeout=10)
    if rc != 0:
        cause = _root_cause(error_file) or _error_summary(list(tail))
        raise TrainingFailed(f"{job.stage}: torchrun exited with code {rc}: {cause}\n" + "\n".join(list(tail)[-30:]))
    if result is None:
        raise TrainingFailed(f"{job.stage}: the worker exited cleanly but reported no result in {events_file}")
    return {**result, "restart_causes": failures}


def restart_tags(result: dict) -> dict[str, str]:
    """The MLflow tags of a worker's restarts: how many, and why (each failure of the worker group, one per line)."""
    tags = {"restarts": str(result["restarts"])}
    if result.get("restart_causes"):
        tags["restart_causes"] = "\n".join(result["restart_causes"])[:5000]
    return tags


def _echo(proc: subprocess.Popen, logger, tail: collections.deque, failures: list[str]) -> None:
    """Each line of the workers' and torchrun's output into the log; each failure of the worker group (torchrun
    restarts it while restarts are left) into ``failures``, with a warning."""
    assert proc.stdout is not None
    since: collections.deque[str] = collections.deque(maxlen=500)  # the lines since the last failure
    for line in proc.stdout:
        line = line.rstrip()
        tail.append(line)
        logger.info(line)
        failure = _failure(line, since)
        if failure is None:
            since.append(line)
            continue
        failures.append(failure)
        since.clear()
        logger.warning("worker group failed (%d): %s", len(failures), failure)
