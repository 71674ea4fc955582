"""The run's other candidates and the choice among them: ``linear`` (TF-IDF + logistic regression or linear SVM,
fitted here, no torchrun), ``ensemble`` (neural and linear averaged) and ``select`` (the best validation macro-F1 wins).

Each candidate's stage run carries the same test metrics and plots as the ``evaluate`` run, plus ``val_macro_f1``;
the parent run gets every candidate's scores side by side and a ``candidates.md`` table.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from training.config import PipelineConfig
from training.data.prepare import load_manifest
from training.linear import fit_linear, merge, refit, split_inputs
from training.metrics import log_evaluation
from training.select import choose_weight, cross_fitted_f1, pick
from tasks.evaluate import save_probs
from tasks.tracking import stage_run

TITLES = {"neural": "neural ({family})", "linear": "linear (TF-IDF {setting})",
          "ensemble": "ensemble (neural and linear averaged)", "distilled": "distilled ({student}, taught by {teacher})"}


def _test_texts(prepared: dict) -> list[str]:
    return pd.read_json(Path(prepared["path"]) / "test.jsonl", lines=True, dtype=False)["text"].tolist()


@task(name="linear")
def linear_candidate(config: PipelineConfig, prepared: dict, parent: dict) -> dict:
    """Fit the linear family on the train split (settings chosen on val), refit them on train + val, score val (first
    fit) and test (refit), save it as plain files."""
    with stage_run(parent, "linear") as run:
        manifest = load_manifest(prepared["path"])
        train, val, test = (split_inputs(prepared["path"], s) for s in ("train", "val", "test"))
        started = time.perf_counter()
        weights = None if config.linear.class_weights == "none" else "balanced"
        chosen, c_scores = fit_linear(train, val, len(manifest["labels"]), config.linear.grid(), weights)
        val_probs = chosen.predict_proba(val.clean, val.tokens)  # what the ensemble weight is chosen on
        model = refit(chosen, merge(train, val), weights) if config.linear.refit else chosen
        mlflow.log_params({"linear.C": model.c, "linear.features": model.features_name,
                           "linear.classifier": model.classifier_name, "linear.temperature": model.temperature,
                           "linear.class_weights": config.linear.class_weights, "linear.n_features": model.n_features,
                           "linear.refit": config.linear.refit, "linear.train_texts": len(train.labels)
                           + (len(val.labels) if config.linear.refit else 0)})
        mlflow.log_metric("fit_seconds", time.perf_counter() - started)
        mlflow.log_dict(c_scores, "val_macro_f1_by_setting.json")
        folder = Path(parent["work_dir"]) / "linear"
        model.save(folder / "model")
        probs = {"val": val_probs, "test": model.predict_proba(test.clean, test.tokens)}
        metrics = log_evaluation(test.labels, probs["test"], manifest["labels"], _test_texts(prepared), "linear: test")
        metrics["val_macro_f1"] = c_scores[model.setting]
        mlflow.log_metric("val_macro_f1", metrics["val_macro_f1"])
        return {"kind": "linear", "metrics": metrics, "run_id": run.info.run_id, "linear_dir": str(folder / "model"),
                "probs": save_probs(folder, probs), "C": model.c, "features": model.features_name,
                "classifier": model.classifier_name, "setting": model.setting}


@task(name="ensemble")
def ensemble_candidate(config: PipelineConfig, neural: dict, linear: dict, prepared: dict, parent: dict) -> dict:
    """Average the two models' probabilities with the neural weight that scores best on val; test only scores it."""
    with stage_run(parent, "ensemble") as run:
        manifest = load_manifest(prepared["path"])
        val_labels = np.load(Path(prepared["path"]) / "val.labels.npy")
        test_labels = np.load(Path(prepared["path"]) / "test.labels.npy")
        val = {k: np.load(c["probs"]["val"]) for k, c in (("neural", neural), ("linear", linear))}
        weight, val_f1 = choose_weight(val["neural"], val["linear"], val_labels)
        honest = cross_fitted_f1(val["neural"], val["linear"], val_labels, seed=config.data.seed)
        test = weight * np.load(neural["probs"]["test"]) + (1 - weight) * np.load(linear["probs"]["test"])
        mlflow.log_params({"ensemble.neural_weight": weight, "ensemble.weight_chosen_on": "val"})
        metrics = log_evaluation(test_labels, test, manifest["labels"], _test_texts(prepared), "ensemble: test")
        # what the choice compares: the score at the weight chosen on validation, as every candidate's is the best of
        # its own choices there (the neural model's epoch, the linear model's features and C); weights 0 and 1 are the
        # two models themselves, which a tie then picks. The cross-fitted score (each half at the other half's
        # weight) is logged beside it: what the weight's choice is worth on texts it did not see
        metrics |= {"val_macro_f1": val_f1, "val_macro_f1_at_chosen_weight": val_f1, "val_macro_f1_cross_fitted": honest}
        mlflow.log_metrics({"val_macro_f1": val_f1, "val_macro_f1_at_chosen_weight": val_f1, "val_macro_f1_cross_fitted": honest})
        return {"kind": "ensemble", "metrics": metrics, "run_id": run.info.run_id, "weight": weight,
                "checkpoint": neural["checkpoint"], "linear_dir": linear["linear_dir"]}


@task(name="select")
def select_candidate(config: PipelineConfig, candidates: dict[str, dict], parent: dict) -> dict:
    """The candidate with the best validation macro-F1 (never test), every candidate's scores in the parent run."""
    val_scores = {name: c["metrics"]["val_macro_f1"] for name, c in candidates.items()}
    chosen = pick(val_scores)
    client = mlflow.MlflowClient()
    rows = ["| candidate | val macro-F1 | test macro-F1 | test accuracy | |", "|---|---|---|---|---|"]
    for name, c in candidates.items():
        m = c["metrics"]
        for key in ("val_macro_f1", "test_macro_f1", "test_accuracy"):
            client.log_metric(parent["run_id"], f"{name}_{key}", m[key])
        title = TITLES[name].format(family=config.model.name, setting=c.get("setting", ""), student=config.distill.student.name,
                                    teacher=" + ".join(config.distill.teacher))
        rows.append(f"| {title} | {m['val_macro_f1']:.4f} | {m['test_macro_f1']:.4f} | {m['test_accuracy']:.4f} | "
                    f"{'**registered**' if name == chosen else ''} |")
    table = "\n".join(rows) + "\n\nChosen by validation macro-F1; the test split only scores the choice.\n"
    client.log_text(parent["run_id"], table, "candidates.md")
    client.set_tag(parent["run_id"], "selected_candidate", chosen)
    create_markdown_artifact(table, key="candidates", description="every candidate's scores; the registered one marked")
    get_run_logger().info("candidates (val macro-F1): %s; registering %s",
                          ", ".join(f"{k} {v:.4f}" for k, v in val_scores.items()), chosen)
    return {**candidates[chosen], "name": chosen}
