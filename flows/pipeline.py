"""The ``train_pipeline`` flow: preprocess -> train -> prune -> fine-tune -> evaluate -> register.

    zhflow run --preset tiny                          # from the shell
    python -c "from flows.pipeline import train_pipeline; from training.config import tiny; train_pipeline(tiny())"
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from training.config import PipelineConfig, default
from tasks.evaluate import evaluate_model
from tasks.preprocess import preprocess
from tasks.prune import prune_model
from tasks.register import register_model
from tasks.tracking import close_pipeline_run, fail_open_runs, open_pipeline_run
from tasks.train import finetune_model, train_model, with_limits


def _run_name() -> str:
    config = flow_run.parameters.get("config")
    model = getattr(getattr(config, "model", None), "name", None) or (config or {}).get("model", {}).get("name", "model")
    return f"train-{model}-{flow_run.scheduled_start_time.strftime('%Y%m%d-%H%M%S')}"


@flow(name="train_pipeline", flow_run_name=_run_name, log_prints=True,
      on_failure=[fail_open_runs], on_crashed=[fail_open_runs], on_cancellation=[fail_open_runs])
def train_pipeline(config: PipelineConfig = default(), experiment: str = "zhflow") -> dict:
    """Train, prune, fine-tune, evaluate and register a Chinese text classifier; every stage tracked in MLflow."""
    parent = open_pipeline_run(config, experiment)
    prepared = preprocess(config.data, config.preprocess, config.augment, parent)
    trained = with_limits(train_model, config.train)(config, prepared, parent)
    evaluated_trained = evaluate_model(config, trained["best_checkpoint"], prepared, parent, stage="evaluate_trained")
    pruned = prune_model(config, trained, prepared, parent)
    finetuned = with_limits(finetune_model, config.train)(config, pruned, prepared, parent)
    evaluated = evaluate_model(config, finetuned["best_checkpoint"], prepared, parent, stage="evaluate")
    model = register_model(config, evaluated, prepared, parent)
    metrics = evaluated["metrics"] | {f"trained_{k}": v for k, v in evaluated_trained["metrics"].items()}
    close_pipeline_run(parent, metrics, {"model_version": model["version"], "alias": model["alias"]})
    return {
        "experiment": parent["experiment"],
        "parent_run_id": parent["run_id"],
        "stage_runs": {
            "preprocess": prepared["run_id"], "train": trained["run_id"], "evaluate_trained": evaluated_trained["run_id"],
            "prune": pruned["run_id"], "finetune": finetuned["run_id"], "evaluate": evaluated["run_id"],
            "register": model["run_id"],
        },
        "metrics": metrics,
        "model": {k: model[k] for k in ("name", "version", "uri", "alias")},
        "prepared_data": prepared["path"],
        "preprocess_cached": prepared["cached"],
        "sparsity": {"before": pruned["sparsity_before"], "after": pruned["sparsity_after"]},
    }
