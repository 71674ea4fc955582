"""Scoring task: any zhflow pyfunc model on any labelled file, recorded as a new MLflow run.

    from tasks.score import score_model
    score_model.fn("models:/zhflow-snownlp-sentiment@champion", "reviews.csv", "zhflow-evaluate")

Everything that can be wrong with the inputs (the file, its columns, the model URI, labels the model
does not know) is found by :func:`check_evaluation` before any run is recorded; the command calls it
too, before a Prefect server starts.
"""

from __future__ import annotations

import csv
import io
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlflow
import pandas as pd
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.entities import LoggedModelInput
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.runtime import flow_run

from training.paths import PathRefused, check_model_uri, check_path
from training.data.readers import RawDataset, decode, read_dataset
from training.metrics import log_evaluation
from tasks.tracking import (PARENT_KIND_TAG, init_local_store, link_to_mlflow, metrics_artifact, origin_tags,
                            training_experiment)

REGISTERED_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))/?")
LABEL_MAP_HELP = 'map them with --label-map FILE (or the flow\'s label_map): JSON {"dataset label": "model label"} or a two-column CSV'


class EvaluationError(ValueError):
    """A model, a dataset and a label map that cannot be scored together; the message says which and why."""


@dataclass
class ResolvedModel:
    labels: list[str]
    name: Optional[str] = None  # registered model name and version: only for models:/NAME/N and models:/NAME@ALIAS
    version: Optional[str] = None
    model_id: Optional[str] = None  # the MLflow 3 logged model the metrics are linked to
    source_run_id: Optional[str] = None  # the run that logged the model


def read_label_map(path: str | Path) -> dict[str, str]:
    """``{"dataset label": "model label"}`` from a JSON object, or from a CSV of two columns after a header line.

        read_label_map("labels.json")   # {"好评": "positive", "差评": "negative"}
    """
    path = Path(path)
    if not path.is_file():
        raise EvaluationError(f"label map {str(path)!r}: no such file")
    text = decode(path)
    if text.lstrip().startswith(("{", "[")):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as err:
            raise EvaluationError(f"{path}: line {err.lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(mapping, dict):
            raise EvaluationError(f'{path}: expected a JSON object {{"dataset label": "model label"}}')
        return {str(k).strip(): str(v).strip() for k, v in mapping.items()}
    rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    for line, row in enumerate(rows[1:], 2):
        if len(row) != 2:
            raise EvaluationError(f"{path}: line {line}: expected two columns (dataset label, model label), got {len(row)}")
    if len(rows) < 2:
        raise EvaluationError(f"{path}: no mappings; expected a JSON object or a header line and rows 'dataset label,model label'")
    return {row[0].strip(): row[1].strip() for row in rows[1:]}


def resolve_model(model_uri: str) -> ResolvedModel:
    """The model's labels (its ``prob_<label>`` output columns) and registry identity, without loading its weights."""
    client = MlflowClient()
    model = ResolvedModel(labels=[])
    try:
        if match := REGISTERED_URI.fullmatch(model_uri):
            version = (client.get_model_version_by_alias(match["name"], match["alias"]) if match["alias"]
                       else client.get_model_version(match["name"], match["version"]))
            model.name, model.version = version.name, str(version.version)
            model.model_id, model.source_run_id = version.model_id, version.run_id
        info = mlflow.models.get_model_info(model_uri)
    except (MlflowException, OSError) as err:
        message = err.message if isinstance(err, MlflowException) else str(err)
        raise EvaluationError(f"model {model_uri!r}: {message.splitlines()[0]}") from None
    model.model_id = model.model_id or info.model_id
    model.source_run_id = model.source_run_id or info.run_id
    outputs = info.signature.outputs.input_names() if info.signature and info.signature.outputs else []
    model.labels = [str(c).removeprefix("prob_") for c in outputs if str(c).startswith("prob_")]
    if not model.labels:
        raise EvaluationError(f"model {model_uri!r}: not a zhflow classifier (its output has no prob_<label> columns)")
    return model


def check_evaluation(
    model_uri: str, dataset: str, label_map: Optional[dict[str, str]] = None, text_column: str = "text",
    label_column: str = "label", text_columns: Optional[list[str]] = None, format: Optional[str] = None,
    encoding: Optional[str] = None, quoting: str = "auto",
) -> tuple[ResolvedModel, RawDataset, int]:
    """The resolved model, the dataset's non-blank texts with labels mapped to the model's, and how many texts were
    blank; else an error that names the file, the labels or the model."""
    try:
        check_path("dataset", dataset)
        check_model_uri("model_uri", model_uri)
    except PathRefused as err:
        raise EvaluationError(str(err)) from None
    raw = read_dataset(dataset, text_column, label_column, text_columns or (), format, encoding, quoting)
    raw_texts = raw.texts
    keep = [i for i, text in enumerate(raw_texts) if text.strip()]
    if not keep:
        raise EvaluationError(f"{raw.source}: every text is empty")
    mapping = label_map or {}
    raw.texts, raw.lines = [raw.texts[i] for i in keep], [raw.lines[i] for i in keep]
    raw.labels = [mapping.get(raw.labels[i], raw.labels[i]) for i in keep]
    model = resolve_model(model_uri)
    unknown = sorted(set(raw.labels) - set(model.labels))
    if unknown:
        raise EvaluationError(
            f"{raw.source}: labels the model does not know: {', '.join(map(repr, unknown))} (model labels: "
            f"{', '.join(map(repr, model.labels))}); {LABEL_MAP_HELP}")
    return model, raw, len(raw_texts) - len(keep)


@task(name="score")
def score_model(
    model_uri: str, dataset: str, experiment: str, label_map: Optional[dict[str, str]] = None, text_column: str = "text",
    label_column: str = "label", text_columns: Optional[list[str]] = None, format: Optional[str] = None,
    encoding: Optional[str] = None, quoting: str = "auto",
) -> dict:
    """Check, predict, log the evaluation into a new run of ``experiment``; return the summary."""
    model, raw, blank = check_evaluation(model_uri, dataset, label_map, text_column, label_column, text_columns, format,
                                         encoding, quoting)
    init_local_store()
    client = MlflowClient()
    experiment_id = training_experiment(client, experiment)
    tags = {PARENT_KIND_TAG: "evaluate", "model_uri": model_uri, "registered_model": model.name,
            "model_version": model.version, "model_id": model.model_id, "source_run_id": model.source_run_id,
            **origin_tags()}
    with mlflow.start_run(experiment_id=experiment_id, run_name=str(flow_run.name or "evaluate"),
                          tags={k: v for k, v in tags.items() if v}) as run:
        mlflow.log_params({"model_uri": model_uri, "dataset": raw.source, "text_columns": ",".join(text_columns or [text_column]),
                           "label_column": label_column, "label_map": json.dumps(label_map or {}, ensure_ascii=False),
                           "blank_texts_dropped": blank})
        frame = pd.DataFrame({"text": raw.texts, "label": raw.labels})
        with warnings.catch_warnings():  # MLflow registers its local-file source twice and warns that it must pick one
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(raw.source)
        data = mlflow.data.from_pandas(frame, source=source, targets="label", name=Path(raw.name).name, digest=raw.digest[:16])
        mlflow.log_input(data, context="evaluation", model=LoggedModelInput(model.model_id) if model.model_id else None)
        predicted = mlflow.pyfunc.load_model(model_uri).predict(raw.texts)
        probs = predicted[[f"prob_{label}" for label in model.labels]].to_numpy()
        y_true = [model.labels.index(label) for label in raw.labels]
        metrics = log_evaluation(y_true, probs, model.labels, raw.texts, f"{Path(raw.name).name}: {model_uri}",
                                 model_id=model.model_id, dataset=data)
        if model.name:
            client.set_model_version_tag(model.name, model.version, "last_evaluation_run_id", run.info.run_id)
    link_to_mlflow(experiment_id, experiment, run.info.run_id)
    metrics_artifact(experiment_id, experiment, run.info.run_id, metrics, {"model": model_uri, "dataset": raw.source})
    print(f"{model_uri} on {raw.source}: accuracy {metrics['test_accuracy']:.4f}, macro-F1 {metrics['test_macro_f1']:.4f} "
          f"over {len(raw.texts)} texts; MLflow run {run.info.run_id}")  # a log line in the flow (log_prints)
    return {"model_uri": model_uri, "model_name": model.name, "model_version": model.version, "run_id": run.info.run_id,
            "experiment": experiment, "dataset": raw.source, "metrics": metrics, "blank_texts_dropped": blank,
            "classes_never_predicted": sorted({raw.labels[i] for i in range(len(raw.labels))} - set(predicted["label"]))}
