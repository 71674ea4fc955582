"""Tracking cost: MLflow logging as the worker does it (per-step values buffered, one ``log_batch`` per epoch)
against one ``log_metric`` call per value, into the same kind of store, interleaved."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient

from bench.common import interleaved, verdict
from training.metric_logger import MetricLogger

STEPS = 200  # optimiser steps in one epoch of the default preset on the built-in corpus (13k texts / batch 64)


def _epoch_batched(client: MlflowClient, run_id: str, epoch: int) -> None:
    log = MetricLogger(run_id, client)
    for step in range(STEPS):
        log.add(epoch * STEPS + step, train_loss=1.0 / (step + 1), lr=1e-3)
    log.add(epoch, val_macro_f1=0.8, val_loss=0.4, epoch_seconds=10.0)
    log.flush()


def _per_call(client: MlflowClient, run_id: str, epoch: int) -> None:
    for step in range(STEPS):
        client.log_metric(run_id, "train_loss", 1.0 / (step + 1), step=epoch * STEPS + step)
        client.log_metric(run_id, "lr", 1e-3, step=epoch * STEPS + step)
    for key, value in (("val_macro_f1", 0.8), ("val_loss", 0.4), ("epoch_seconds", 10.0)):
        client.log_metric(run_id, key, value, step=epoch)


def run(quick: bool, repeats: int) -> str:
    epochs = 2 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        client = MlflowClient(f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        experiment = client.create_experiment("tracking")
        runs = {"batched": client.create_run(experiment).info.run_id, "per call": client.create_run(experiment).info.run_id}
        counter = {"batched": 0, "per call": 0}

        def epoch_of(name, fn):
            def go():
                fn(client, runs[name], counter[name])
                counter[name] += 1
            return go

        timings = interleaved({"batched": epoch_of("batched", _epoch_batched), "per call": epoch_of("per call", _per_call)},
                              max(repeats, epochs))
        stored = {name: len(client.get_metric_history(run_id, "train_loss")) for name, run_id in runs.items()}
    ratio = timings["per call"].median / timings["batched"].median
    values = 2 * STEPS + 3
    return "\n".join([
        "## Tracking cost",
        "",
        f"One epoch's metrics as the worker logs them: {STEPS} steps x (train_loss, lr) plus 3 epoch metrics = {values} values, "
        f"into a local SQLite MLflow store. {max(repeats, epochs)} epochs each, interleaved; median seconds per epoch.",
        "",
        "| how | seconds per epoch | values stored (train_loss) |",
        "|---|---|---|",
        f"| buffered, one `log_batch` per epoch (the worker) | {timings['batched']} | {stored['batched']} |",
        f"| one `log_metric` call per value | {timings['per call']} | {stored['per call']} |",
        "",
        f"- Per-call logging costs {ratio:.0f}x the batched logging; batched, tracking adds "
        f"{1000 * timings['batched'].median:.0f} ms to an epoch (zhflow's target: under 0.2 s, 1% of a default-preset epoch "
        f"of about 20 s: {verdict(timings['batched'].median < 0.2)}). Both stored every value: "
        f"{verdict(stored['batched'] == stored['per call'])}.",
        "- Here every step is logged, to compare the mechanisms; the worker records the training loss every "
        "`train.log_every` steps (default 20), 20 times fewer values again.",
        "",
    ])
