"""Evaluation task: one process over the whole test split (no sampler padding)."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
from prefect import task

from training.config import PipelineConfig
from training.data.prepare import load_manifest
from training.evaluate import load_model, open_split, predict_proba
from training.metrics import log_evaluation
from training.models import min_input_len
from training.prune import sparsity
from tasks.tracking import stage_run


@task(name="evaluate")
def evaluate_model(config: PipelineConfig, checkpoint: str, prepared: dict, parent: dict, stage: str = "evaluate") -> dict:
    with stage_run(parent, stage) as run:
        labels = load_manifest(prepared["path"])["labels"]
        model, model_cfg, _ = load_model(checkpoint)  # the checkpoint's own sizes (structured pruning shrinks them)
        test = open_split(prepared["path"], "test", model_cfg, config.preprocess.max_len)
        probs = predict_proba(model, test, config.evaluate.batch_size, min_input_len(model_cfg))
        # the texts as the user wrote them, for the error analysis; same order as the encoded split
        texts = pd.read_json(Path(prepared["path"]) / "test.jsonl", lines=True, dtype=False)["text"].tolist()
        metrics = log_evaluation(test.labels, probs, labels, texts, f"{stage}: test")
        metrics["sparsity_prunable"] = sparsity(model)["sparsity_prunable"]
        mlflow.log_metric("sparsity_prunable", metrics["sparsity_prunable"])
        mlflow.set_tag("checkpoint", checkpoint)
        return {"metrics": metrics, "run_id": run.info.run_id, "checkpoint": checkpoint}
