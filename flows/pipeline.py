"""The ``train_pipeline`` flow: preprocess -> train -> evaluate -> baseline -> prune + fine-tune (rounds) -> evaluate -> register.

    zhflow run --preset tiny                          # from the shell
    python -c "from flows.pipeline import train_pipeline; from training.config import tiny; train_pipeline(tiny())"
"""

from __future__ import annotations

from typing import Optional

from prefect import flow
from prefect.runtime import flow_run

from training.config import ExperimentName, PipelineConfig, PresetName, default, on_preset
from training.paths import check_config_paths
from tasks.baseline import baseline_model
from tasks.evaluate import evaluate_model
from tasks.preprocess import preprocess
from tasks.prune import prune_report, prune_round
from tasks.register import register_model
from tasks.schedule import scheduled_slot, skipped
from tasks.tracking import close_pipeline_run, fail_open_runs, open_pipeline_run, open_stage_run
from tasks.train import train_model, with_limits

REPORTED = ("file_size_ratio", "speedup_b1", "speedup_b64", "test_macro_f1_change", "after_params", "after_file_bytes",
            "after_sparsity_prunable", "after_latency_b64_p50_ms")


def _run_name() -> str:
    config = flow_run.parameters.get("config")
    model = getattr(getattr(config, "model", None), "name", None) or (config or {}).get("model", {}).get("name", "model")
    return f"train-{model}-{flow_run.scheduled_start_time.strftime('%Y%m%d-%H%M%S')}"


@flow(name="train_pipeline", flow_run_name=_run_name, log_prints=True,
      on_failure=[fail_open_runs], on_crashed=[fail_open_runs], on_cancellation=[fail_open_runs])
def train_pipeline(config: PipelineConfig = default(), experiment: ExperimentName = "zhflow",
                   preset: Optional[PresetName] = None) -> dict:
    """Train, prune, fine-tune, evaluate and register a Chinese text classifier; every stage tracked in MLflow.

    Args:
        config: Every setting of the run. With a preset, only the settings changed from their defaults here apply, on top of the preset.
        experiment: MLflow experiment of the run (created if missing).
        preset: Start from a preset: tiny (a 600-text subset, seconds), default (the whole corpus, minutes on a CPU), gpu (a wider model for a CUDA machine). Empty: the settings below as they are.
    """
    slot = scheduled_slot()
    if slot["superseded"]:
        return skipped(slot)
    config = on_preset(config, preset)
    check_config_paths(config)  # a path from the form may not leave the allowed folders
    parent = open_pipeline_run(config, experiment)
    prepared = preprocess(config.data, config.preprocess, config.augment, parent)
    trained = with_limits(train_model, config.train)(config, prepared, parent)
    evaluated_trained = evaluate_model(config, trained["best_checkpoint"], prepared, parent, stage="evaluate_trained")
    baseline = baseline_model(config, prepared, parent)
    prune_parent = open_stage_run(parent, "prune")
    current, rounds = trained["best_checkpoint"], []
    if config.prune.amount > 0:
        for round_no, amount in enumerate(config.prune.round_amounts(), 1):
            done = with_limits(prune_round, config.train)(config, current, prepared, prune_parent, round_no, amount)
            rounds.append(done)
            current = done["checkpoint"]
    evaluated = evaluate_model(config, current, prepared, parent, stage="evaluate")
    pruning = prune_report(config, trained, evaluated_trained, rounds, evaluated, prepared, prune_parent)
    model = register_model(config, evaluated, prepared, parent, slot=slot["key"])
    metrics = (evaluated["metrics"] | {f"trained_{k}": v for k, v in evaluated_trained["metrics"].items()}
               | {f"baseline_{k}": v for k, v in baseline["metrics"].items()}
               | {f"prune_{k}": pruning["metrics"][k] for k in REPORTED})
    close_pipeline_run(parent, metrics, {"model_version": model["version"], "alias": model["alias"]})
    return {
        "experiment": parent["experiment"],
        "parent_run_id": parent["run_id"],
        "stage_runs": {
            "preprocess": prepared["run_id"], "train": trained["run_id"], "evaluate_trained": evaluated_trained["run_id"],
            "baseline": baseline["run_id"], "prune": pruning["run_id"], "evaluate": evaluated["run_id"], "register": model["run_id"],
        },
        "prune_rounds": pruning["rounds"],
        "metrics": metrics,
        "model": {k: model[k] for k in ("name", "version", "uri", "alias")},
        "prepared_data": prepared["path"],
        "preprocess_cached": prepared["cached"],
        "sparsity": {"before": pruning["metrics"]["before_sparsity_prunable"], "after": pruning["metrics"]["after_sparsity_prunable"]},
    }
