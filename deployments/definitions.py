"""The zhflow deployments, defined once: ``zhflow deploy`` puts them on a process work pool, ``zhflow serve`` serves
them from one process. Same names, schedules, parameters and limits either way.

| deployment                       | schedule                        | default parameters                          |
|----------------------------------|---------------------------------|---------------------------------------------|
| ``train_pipeline/nightly-retrain`` | 02:00 every day (Asia/Shanghai) | preset default, experiment zhflow-nightly   |
| ``sweep/weekly-sweep``             | 03:00 every Saturday            | 12 trials, study weekly (continued each week) |
| ``evaluate/evaluate-champion``     | on demand                       | the champion; the dataset is asked for      |
| ``pretrain/pretrain-encoder``      | on demand                       | the corpus files are asked for              |

Runs missed while no worker ran: only the newest missed run of a deployment runs, the rest end Cancelled
(tasks/schedule.py). One run of each deployment at a time: a run that comes while another runs waits.
"""

from __future__ import annotations

import json
import os

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.schedules import Cron

from flows.evaluate import evaluate
from flows.pipeline import train_pipeline
from flows.pretrain import pretrain
from flows.sweep import sweep
from training.config import PipelineConfig
from training.presets import default

TIMEZONE = os.environ.get("ZHFLOW_TIMEZONE", "Asia/Shanghai")
ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
TAGS = ["zhflow"]


def nightly_retrain(**options) -> RunnerDeployment:
    """Every night at 02:00: the default pipeline on the built-in corpus; the champion alias moves only on a win."""
    return train_pipeline.to_deployment(
        name="nightly-retrain",
        schedule=Cron("0 2 * * *", timezone=TIMEZONE),
        parameters={"preset": "default", "experiment": "zhflow-nightly"},
        concurrency_limit=ONE_AT_A_TIME,
        description="Retrain, prune, evaluate and register the classifier (the champion alias moves only if it wins). "
                    "Pick a preset (tiny for a quick check) and change any setting in the form.",
        tags=TAGS + ["retrain"], **options,
    )


def weekly_sweep(**options) -> RunnerDeployment:
    """Saturdays at 03:00: 12 more trials of the study ``weekly``; its best model is registered like a retrain's."""
    return sweep.to_deployment(
        name="weekly-sweep",
        schedule=Cron("0 3 * * 6", timezone=TIMEZONE),
        parameters={"trials": 12, "study": "weekly", "experiment": "zhflow-sweep", "preset": "default"},
        concurrency_limit=ONE_AT_A_TIME,
        description="Hyperparameter sweep (Optuna, early stopping); the study continues from week to week.",
        tags=TAGS + ["sweep"], **options,
    )


def evaluate_champion(**options) -> RunnerDeployment:
    """On demand: score the champion (or any model URI) on a labelled dataset given in the form."""
    return evaluate.to_deployment(
        name="evaluate-champion",
        parameters={"model_uri": "models:/zhflow-snownlp-sentiment@champion"},
        description="Score a registered model on a labelled CSV/TSV/JSONL/Parquet file: metrics, confusion matrix, "
                    "errors, as a new MLflow run linked to the model version.",
        tags=TAGS + ["evaluate"], **options,
    )


def pretrain_encoder(**options) -> RunnerDeployment:
    """On demand: masked-LM pretraining of an encoder on the corpus files given in the form."""
    return pretrain.to_deployment(
        name="pretrain-encoder",
        parameters={"experiment": "zhflow-pretrain"},
        concurrency_limit=ONE_AT_A_TIME,
        description="Pretrain a Chinese encoder with masked-language modelling (whole-word masking from jieba) on "
                    "unlabelled text, from scratch or continued from a checkpoint, under DDP or FSDP2; the result is a "
                    "save_pretrained folder that the pretrained family fine-tunes. Give the corpus files in the form.",
        tags=TAGS + ["pretrain"], **options,
    )


ALL = (nightly_retrain, weekly_sweep, evaluate_champion, pretrain_encoder)

# the Prefect form labels each flow parameter with its name; these read better
TITLES = {
    "config": "Settings", "experiment": "MLflow experiment", "preset": "Preset", "trials": "Trials", "sampler": "Sampler",
    "pruner": "Early stopping (pruner)", "space": "Search space", "parallel": "Trials at once", "study": "Optuna study",
    "seed": "Sampler seed", "model_uri": "Model URI", "dataset": "Dataset", "label_map": "Label map",
    "text_column": "Text column", "label_column": "Label column", "text_columns": "Text columns", "format": "File format",
    "encoding": "Encoding", "quoting": "Quoting",
}


# the settings sections of the form: their fields start empty (no schema default), so that the form sends only what
# a person typed and every setting left empty comes from the chosen preset (training.config.on_preset)
SECTIONS = {field.annotation.__name__: section for section, field in PipelineConfig.model_fields.items()}


def _titled(deployment: RunnerDeployment) -> RunnerDeployment:
    schema = deployment._parameter_openapi_schema
    for name, field in schema.properties.items():
        field["title"] = TITLES.get(name, name.replace("_", " ").capitalize())
    if deployment.flow_name == "pretrain":  # its own settings, shown with their defaults (no preset behind them)
        return deployment
    shown = default().model_dump(mode="json")
    for name, definition in (schema.definitions or {}).items():
        for key, field in definition.get("properties", {}).items() if name in SECTIONS else ():
            field.pop("default", None)
            own, value = field.get("description", "").rstrip(), shown[SECTIONS[name]][key]
            if value is None:  # the setting's own "Empty: ..." is what its unset value means, not what the form does
                field["description"] = (f"{own.replace('Empty:', 'Unset:').replace('Empty keeps', 'Unset keeps')} "
                                        "Empty: the preset's value (the default preset leaves it unset).")
            else:
                field["description"] = f"{own} Empty: the preset's value (default preset: {json.dumps(value, ensure_ascii=False)})."
    return deployment


def deployments(**options) -> list[RunnerDeployment]:
    return [_titled(make(**options)) for make in ALL]


def for_work_pool(pool: str, job_variables: dict) -> list[RunnerDeployment]:
    """The deployments for a process work pool: the flows imported by module path from the installed package."""
    return deployments(work_pool_name=pool, job_variables=job_variables, entrypoint_type=EntrypointType.MODULE_PATH)
