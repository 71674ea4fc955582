"""The ``train_pipeline`` flow: preprocess -> train -> evaluate -> baseline -> prune + fine-tune (rounds) -> evaluate
-> distill (optional) -> linear -> ensemble -> select (best validation macro-F1) -> register.

    zhflow run --preset tiny                          # from the shell
    python -c "from flows.pipeline import train_pipeline; from training.presets import tiny; train_pipeline(tiny())"
"""

from __future__ import annotations

from typing import Optional

from prefect import flow
from prefect.runtime import flow_run

from training.config import ExperimentName, PipelineConfig
from training.models import check_model, check_student, tokenizer_source
from training.evaluate import check_precision
from training.presets import PresetName, on_preset
from training.paths import check_config_paths
from tasks.baseline import baseline_model
from tasks.candidates import ensemble_candidate, linear_candidate, select_candidate
from tasks.distill import check_teachers, comparable, distil, distill_report, train_student
from tasks.evaluate import evaluate_model
from tasks.preprocess import preprocess
from tasks.prune import prune_report, prune_round
from tasks.register import register_model
from tasks.schedule import scheduled_slot, skipped
from tasks.tracking import close_pipeline_run, fail_open_runs, open_pipeline_run, open_stage_run
from tasks.train import train_model, with_limits

REPORTED = ("removed_params", "file_size_ratio", "speedup_b1", "speedup_b64", "test_macro_f1_change", "after_params", "after_file_bytes",
            "after_sparsity_prunable", "after_latency_b64_p50_ms")


def _run_name() -> str:
    """train-<family>-<time>; distill-<student family>-<time> for a run that trains only a student (zhflow distill)."""
    config = flow_run.parameters.get("config")
    config = config.model_dump() if hasattr(config, "model_dump") else (config or {})
    distill = config.get("distill") or {}
    if distill.get("enabled") and not (config.get("select") or {}).get("candidates", ["neural"]):
        kind, model = "distill", (distill.get("student") or {}).get("name", "student")
    else:
        kind, model = "train", (config.get("model") or {}).get("name", "model")
    return f"{kind}-{model}-{flow_run.scheduled_start_time.strftime('%Y%m%d-%H%M%S')}"


@flow(name="train_pipeline", flow_run_name=_run_name, log_prints=True,
      on_failure=[fail_open_runs], on_crashed=[fail_open_runs], on_cancellation=[fail_open_runs])
def train_pipeline(config: Optional[PipelineConfig] = None, experiment: ExperimentName = "zhflow",
                   preset: Optional[PresetName] = None) -> dict:
    """Train, prune, fine-tune, evaluate and register a Chinese text classifier; every stage tracked in MLflow.

    Args:
        config: The settings of the run. With a preset, every setting given here applies, whatever its value, and every one left empty comes from the preset.
        experiment: MLflow experiment of the run (created if missing).
        preset: Start from a preset: tiny (a 600-text subset, seconds), default (the whole corpus, minutes on a CPU), gpu (a wider model for a CUDA machine), finetune (fine-tune a pretrained Chinese encoder, model.pretrained). Empty: the settings as given (the default preset when none are).
    """
    slot = scheduled_slot()
    if slot["superseded"]:
        return skipped(slot)
    config = on_preset(config, preset)
    check_config_paths(config)  # a path from the form may not leave the allowed folders
    check_model(config.model)  # a pretrained checkpoint that cannot be loaded: refused before any run is opened
    check_precision(config)  # fp16 without CUDA: the same
    if config.distill.enabled:
        check_student(config.distill.student, config.model)
    parent = open_pipeline_run(config, experiment)
    prepared = preprocess(config.data, config.preprocess, config.augment, parent, tokenizer_source(config.model))
    check_teachers(config.distill, prepared["manifest"]["labels"])  # a teacher of other labels: refused before training
    stage_runs, metrics, neural, distilled = {"preprocess": prepared["run_id"]}, {}, None, None
    baseline = baseline_model(config, prepared, parent)
    if "neural" in config.select.candidates:
        neural, stages, neural_metrics, prune_rounds, sparsity = train_neural(config, prepared, parent)
        stage_runs |= stages
        metrics |= neural_metrics
    if config.distill.enabled:
        distilled, distill_metrics = distill_stage(config, prepared, parent, neural)
        stage_runs["distill"] = distilled["distill_run_id"]
        metrics |= distill_metrics
    stage_runs["baseline"] = baseline["run_id"]
    chosen, candidates = choose_candidate(config, neural, prepared, parent, distilled)
    stage_runs |= {name: c["run_id"] for name, c in candidates.items() if name != "neural"}
    model = register_model(config, chosen, prepared, parent, slot=slot["key"])
    stage_runs["register"] = model["run_id"]
    metrics = ({k: v for k, v in chosen["metrics"].items() if k.startswith("test_")} | metrics
               | {f"baseline_{k}": v for k, v in baseline["metrics"].items()}
               | {f"{name}_{k}": v for name, c in candidates.items() for k, v in c["metrics"].items()
                  if k in ("test_macro_f1", "test_accuracy", "val_macro_f1")})
    close_pipeline_run(parent, metrics, {"model_version": model["version"], "alias": model["alias"],
                                         "registered_model": model["name"], "selected_candidate": chosen["name"]})
    return {
        "experiment": parent["experiment"],
        "parent_run_id": parent["run_id"],
        "stage_runs": stage_runs,
        "prune_rounds": prune_rounds if neural else [],
        "metrics": metrics,
        "candidates": {name: {"val_macro_f1": c["metrics"]["val_macro_f1"], "test_macro_f1": c["metrics"]["test_macro_f1"],
                              "test_accuracy": c["metrics"]["test_accuracy"]} for name, c in candidates.items()},
        "selected": chosen["name"],
        "training": {k: neural["trained"][k] for k in ("stop_reason", "still_improving", "epochs_run", "best_epoch")} if neural else None,
        "model": {k: model[k] for k in ("name", "version", "uri", "alias", "kind")} | {"reason": model.get("alias_reason")},
        "prepared_data": prepared["path"],
        "preprocess_cached": prepared["cached"],
        "sparsity": sparsity if neural else None,
    }


def train_neural(config: PipelineConfig, prepared: dict, parent: dict) -> tuple[dict, dict, dict, list, dict]:
    """The neural candidate: train, evaluate, prune + fine-tune in rounds, evaluate again, the before/after report."""
    trained = with_limits(train_model, config.train)(config, prepared, parent)
    evaluated_trained = evaluate_model(config, trained["best_checkpoint"], prepared, parent, stage="evaluate_trained")
    prune_parent = open_stage_run(parent, "prune")
    current, rounds = trained["best_checkpoint"], []
    if config.prune.amount > 0:
        for round_no, amount in enumerate(config.prune.round_amounts(), 1):
            done = with_limits(prune_round, config.train)(config, current, prepared, prune_parent, round_no, amount)
            rounds.append(done)
            current = done["checkpoint"]
    evaluated = evaluate_model(config, current, prepared, parent, stage="evaluate")
    pruning = prune_report(config, trained, evaluated_trained, rounds, evaluated, prepared, prune_parent)
    stages = {"train": trained["run_id"], "evaluate_trained": evaluated_trained["run_id"], "prune": pruning["run_id"],
              "evaluate": evaluated["run_id"]}
    metrics = ({"sparsity_prunable": evaluated["metrics"]["sparsity_prunable"]}
               | {f"trained_{k}": v for k, v in evaluated_trained["metrics"].items()}
               | {f"prune_{k}": pruning["metrics"][k] for k in REPORTED})
    sparsity = {"before": pruning["metrics"]["before_sparsity_prunable"], "after": pruning["metrics"]["after_sparsity_prunable"]}
    return {**evaluated, "trained": trained, "evaluated_trained": evaluated_trained}, stages, metrics, pruning["rounds"], sparsity


def distill_stage(config: PipelineConfig, prepared: dict, parent: dict, neural: dict | None) -> tuple[dict, dict]:
    """The distilled candidate: the teachers' probabilities (cached), the student alone (the run's own neural model
    when it is the same student, else trained here), the distilled student, and the three side by side."""
    distill_parent = open_stage_run(parent, "distill")
    trained = neural["trained"] if neural else None
    student_data, teacher, student = distil(config, prepared, distill_parent, trained["best_checkpoint"] if trained else None)
    if neural and comparable(config):
        alone = neural["evaluated_trained"]
    else:
        alone_trained = with_limits(train_student, config.distill.train)(config, prepared, distill_parent, None, stage="train_alone")
        alone = evaluate_model(config, alone_trained["best_checkpoint"], prepared, distill_parent, stage="evaluate_alone")
    distilled = evaluate_model(config, student["best_checkpoint"], student_data, distill_parent, stage="evaluate_student")
    report = distill_report(config, prepared, distill_parent, teacher, trained, alone, distilled)
    teacher_record = {"teacher": ",".join(config.distill.teacher), "teacher_identity": ";".join(t["identity"] for t in teacher["teachers"]),
                      "teacher_test_macro_f1": teacher["scores"]["test_macro_f1"]}
    return ({**distilled, "trained": student, "teacher": teacher_record, "distill_run_id": distill_parent["run_id"]},
            {f"distill_{k}": v for k, v in report["metrics"].items()})


def choose_candidate(config: PipelineConfig, neural: dict | None, prepared: dict, parent: dict,
                     distilled: dict | None = None) -> tuple[dict, dict]:
    """The candidates ``select.candidates`` asks for (and the distilled student, with ``distill.enabled``), and the one
    with the best validation macro-F1."""
    wanted = config.select.candidates
    candidates = {"neural": neural} if neural else {}
    if distilled:
        candidates["distilled"] = distilled
    if "linear" in wanted:
        candidates["linear"] = linear_candidate(config, prepared, parent)
    if "ensemble" in wanted:
        candidates["ensemble"] = ensemble_candidate(config, neural, candidates["linear"], prepared, parent)
    return select_candidate(config, candidates, parent), candidates
