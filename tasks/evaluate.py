"""Evaluation task: one process over the whole test split (no sampler padding)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import pandas as pd
from prefect import task

from training.config import PipelineConfig
from training.data.prepare import load_manifest
from training.evaluate import load_model, open_split, predict_proba
from training.metrics import classification_metrics, per_class_report, plot_confusion_matrix
from training.models import min_input_len
from training.prune import sparsity
from tasks.tracking import stage_run


@task(name="evaluate")
def evaluate_model(config: PipelineConfig, checkpoint: str, prepared: dict, parent: dict, stage: str = "evaluate") -> dict:
    with stage_run(parent, stage) as run:
        labels = load_manifest(prepared["path"])["labels"]
        model, _, _ = load_model(checkpoint)
        test = open_split(prepared["path"], "test", config.model, config.preprocess.max_len)
        probs = predict_proba(model, test, config.evaluate.batch_size, min_input_len(config.model))
        y_true, y_pred = test.labels, probs.argmax(1)
        metrics = classification_metrics(y_true, y_pred, prefix="test_")
        metrics["test_texts"] = float(len(y_true))
        metrics["sparsity_prunable"] = sparsity(model)["sparsity_prunable"]
        mlflow.log_metrics(metrics)
        mlflow.set_tag("checkpoint", checkpoint)
        mlflow.log_dict(per_class_report(y_true, y_pred, labels), "per_class_report.json")
        with tempfile.TemporaryDirectory() as tmp:
            png = plot_confusion_matrix(y_true, y_pred, labels, Path(tmp) / "confusion_matrix.png",
                                        f"{stage}: test macro-F1 {metrics['test_macro_f1']:.4f}")
            mlflow.log_artifact(str(png))
            frame = pd.DataFrame({"true": [labels[i] for i in y_true], "predicted": [labels[i] for i in y_pred]}
                                 | {f"prob_{name}": probs[:, j] for j, name in enumerate(labels)})
            frame.to_csv(Path(tmp) / "test_predictions.csv", index=False)
            mlflow.log_artifact(str(Path(tmp) / "test_predictions.csv"))
        return {"metrics": metrics, "run_id": run.info.run_id, "checkpoint": checkpoint}
