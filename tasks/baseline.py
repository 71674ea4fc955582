"""Baseline task: TF-IDF character n-grams + linear SVM on the same split, scored like the neural model.

Its nested ``baseline`` run carries the same metric names as the ``evaluate`` run (``test_macro_f1``,
...), so the two sit side by side in the MLflow UI's run comparison.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import pandas as pd
from prefect import task

from training.baseline import BASELINE_NAME, BASELINE_PARAMS, class_scores, fit_baseline
from training.config import PipelineConfig
from training.data.prepare import load_manifest
from training.metrics import log_evaluation
from tasks.tracking import stage_run


def _split(prepared_dir: str, name: str) -> pd.DataFrame:
    frame = pd.read_json(Path(prepared_dir) / f"{name}.jsonl", lines=True, dtype=False)
    # augmented copies are token lists joined by spaces, not texts: the baseline learns from the originals
    return frame[~frame["augmented"].fillna(False).astype(bool)] if "augmented" in frame else frame


@task(name="baseline")
def baseline_model(config: PipelineConfig, prepared: dict, parent: dict) -> dict:
    """Fit on the train split's cleaned texts (not val: the same data the neural model learns from), score the test split."""
    with stage_run(parent, "baseline") as run:
        manifest = load_manifest(prepared["path"])
        label_index = manifest["label_map"]
        train, test = _split(prepared["path"], "train"), _split(prepared["path"], "test")
        mlflow.log_params({"baseline.model": BASELINE_NAME} | {f"baseline.{k}": v for k, v in BASELINE_PARAMS.items()}
                          | {"baseline.train_texts": len(train)})
        started = time.perf_counter()
        model = fit_baseline(train["clean"], [label_index[label] for label in train["label"]])
        mlflow.log_metric("fit_seconds", time.perf_counter() - started)
        assert list(model.classes_) == list(range(len(manifest["labels"])))  # every class is in every split
        y_true = [label_index[label] for label in test["label"]]
        metrics = log_evaluation(y_true, class_scores(model, test["clean"]), manifest["labels"], test["text"].tolist(),
                                 "baseline (TF-IDF char 1-3 grams + linear SVM): test")
        return {"metrics": metrics, "run_id": run.info.run_id}
