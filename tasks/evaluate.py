"""Evaluation task: one process over the whole test split (no sampler padding)."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from prefect import task
from sklearn.metrics import f1_score

from training.config import PipelineConfig
from training.data.prepare import load_manifest
from training.evaluate import load_model, open_split, predict_proba
from training.metrics import log_evaluation
from training.prune import sparsity
from tasks.tracking import stage_run


@task(name="evaluate")
def evaluate_model(config: PipelineConfig, checkpoint: str, prepared: dict, parent: dict, stage: str = "evaluate") -> dict:
    """Score ``checkpoint`` on the test split (the metrics, plots and error lists of its ``stage`` run) and on the
    validation split (``val_macro_f1``, what candidates are chosen by). Both splits' probabilities are saved beside
    the checkpoint's run folder for the ensemble."""
    with stage_run(parent, stage) as run:
        labels = load_manifest(prepared["path"])["labels"]
        model, model_cfg, _ = load_model(checkpoint)  # the checkpoint's own sizes (structured pruning shrinks them)
        probs = {}
        for split in ("val", "test"):
            data = open_split(prepared["path"], split, model_cfg, config.preprocess.max_len)
            probs[split] = (predict_proba(model, data, config.evaluate.batch_size), data.labels)
        # the texts as the user wrote them, for the error analysis; same order as the encoded split
        texts = pd.read_json(Path(prepared["path"]) / "test.jsonl", lines=True, dtype=False)["text"].tolist()
        metrics = log_evaluation(probs["test"][1], probs["test"][0], labels, texts, f"{stage}: test")
        metrics["val_macro_f1"] = float(f1_score(probs["val"][1], probs["val"][0].argmax(1), average="macro"))
        metrics["sparsity_prunable"] = sparsity(model)["sparsity_prunable"]
        mlflow.log_metrics({k: metrics[k] for k in ("val_macro_f1", "sparsity_prunable")})
        mlflow.set_tag("checkpoint", checkpoint)
        saved = save_probs(Path(parent["work_dir"]) / stage, {split: p for split, (p, _) in probs.items()})
        return {"kind": "neural", "metrics": metrics, "run_id": run.info.run_id, "checkpoint": checkpoint, "probs": saved,
                "model": model_cfg.model_dump(), "prepared_dir": prepared["path"]}


def save_probs(folder: Path, probs: dict) -> dict[str, str]:
    """Class probabilities per split as ``{split}_probs.npy`` in ``folder``; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, values in probs.items():
        np.save(folder / f"{split}_probs.npy", np.asarray(values, dtype=np.float64))
    return {split: str(folder / f"{split}_probs.npy") for split in probs}
