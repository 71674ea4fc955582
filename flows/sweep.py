"""The ``sweep`` flow: an Optuna study over the pipeline's settings, then the best model evaluated and registered.

    zhflow sweep --preset tiny --trials 6 --parallel 2 --study my-sweep
    python -c "from flows.sweep import sweep; from training.presets import tiny; sweep(tiny(), trials=4)"
"""

from __future__ import annotations

import math
import os
from typing import Annotated, Literal, Optional

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from training.config import ExperimentName, PipelineConfig
from training.models import check_model, check_student
from training.presets import PresetName, on_preset
from training.paths import check_config_paths, check_space_paths
from training.sweep import STUDY_NAME, check_space, default_space, grid
from flows.pipeline import choose_candidate
from tasks.baseline import baseline_model
from tasks.evaluate import evaluate_model
from tasks.register import register_model
from tasks.schedule import scheduled_slot, skipped
from tasks.sweep import (free_stale_slots, log_sweep_summary, open_study, optimize, recover_interrupted, run_trial, share_gpus,
                         study_storage)
from tasks.tracking import close_pipeline_run, fail_open_runs, open_pipeline_run


def _name() -> str:
    study = flow_run.parameters.get("study")
    return f"sweep-{study}" if study else f"sweep-{flow_run.scheduled_start_time.strftime('%Y%m%d-%H%M%S')}"


@flow(name="sweep", flow_run_name=_name, log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16),
      on_failure=[fail_open_runs], on_crashed=[fail_open_runs], on_cancellation=[fail_open_runs])
def sweep(
    config: Optional[PipelineConfig] = None,
    trials: Annotated[int, Field(ge=1, le=10_000)] = 8,
    sampler: Literal["tpe", "random", "grid"] = "tpe",
    pruner: Literal["median", "successive_halving", "none"] = "median",
    space: Optional[dict[str, dict]] = None,
    parallel: Annotated[int, Field(ge=1, le=256)] = 1,
    study: Optional[Annotated[str, Field(min_length=1, max_length=200, pattern=STUDY_NAME)]] = None,
    seed: Optional[Annotated[int, Field(ge=0, le=2**32 - 1)]] = 13,
    experiment: ExperimentName = "zhflow-sweep",
    preset: Optional[PresetName] = None,
) -> dict:
    """Search the settings with Optuna (bad trials stopped early), then evaluate and register the best model.

    Args:
        config: The settings every trial starts from; the search space overrides some of them. With a preset, every setting given here applies, whatever its value, and every one left empty comes from the preset.
        trials: Trials to run in this call (a continued study adds them to its earlier ones).
        sampler: tpe (Bayesian), random, or grid (every combination of the space's choices).
        pruner: Stops a trial whose validation macro-F1 falls behind: median of the finished trials at the same epoch, or successive halving.
        space: Settings to search, e.g. {"train.lr": {"low": 0.0003, "high": 0.003, "log": true}}. Empty: the built-in space (for the pretrained family: learning rate, batch size, warm-up, epochs, weight decay).
        parallel: Trials run at once; each gets its share of the CPU cores, or its own GPU(s) on a GPU machine.
        study: Optuna study name; running again with the same name continues that study (not / % & < >). Empty: a new study.
        seed: Seed of the sampler: with parallel 1, the same seed and space give the same suggestions.
        experiment: MLflow experiment of the sweep's runs.
        preset: Start the trials from a preset (tiny, default, gpu, finetune), the settings given in config on top. Empty: config as it is (the default preset when config is empty too).
    """
    logger = get_run_logger()
    if trials < 1 or parallel < 1:
        raise ValueError(f"trials and parallel must be at least 1, got trials={trials}, parallel={parallel}")
    slot = scheduled_slot()
    if slot["superseded"]:
        return skipped(slot)
    config = on_preset(config, preset)
    check_config_paths(config)  # a path from the form may not leave the allowed folders
    check_model(config.model)  # a pretrained checkpoint that cannot be loaded: refused before any run is opened
    if config.distill.enabled:
        check_student(config.distill.student, config.model)
    space = check_space(space or default_space(config))
    check_space_paths(space)  # a file setting searched over: its every choice is checked too
    if sampler == "grid":
        trials = min(trials, math.prod(len(values) for values in grid(space).values()))
    study_name = study or f"zhflow-{flow_run.id or 'local'}"
    storage = study_storage()
    cores = os.cpu_count() or 1
    cpus = max(1, cores // parallel)
    limit = f"zhflow-sweep-{study_name}"[:100]
    gpus_each = share_gpus(limit, parallel)  # a GPU machine: each trial its own GPU(s)
    if config.train.nproc is None and gpus_each:  # one process per GPU; on CPU, per core of the trial's share
        config = config.model_copy(update={"train": config.train.model_copy(update={"nproc": gpus_each})})
    parent = open_pipeline_run(config, experiment, kind="sweep")
    opened = open_study(study_name, storage, sampler, pruner, space, seed)
    if redo := recover_interrupted(opened):
        logger.warning("study %r: trial(s) %s of an earlier sweep did not finish (interrupted, or their process lost); "
                       "they are run again first", study_name, redo)
    earlier = len(opened.trials)
    if freed := free_stale_slots(opened, limit, parallel):
        logger.warning("study %r: %d trial slot(s) of an interrupted sweep freed", study_name, freed)
    logger.info("study %r (%d earlier trials) in %s; %d trial(s), %d at a time, %d core(s) each",
                study_name, earlier, storage.split("@")[-1], trials, parallel, cpus)
    # the sampler's seed follows the study's trial count: a continued study does not repeat its first suggestions
    study_now = open_study(study_name, storage, sampler, pruner, space, None if seed is None else seed + earlier)
    results = optimize(study_now, trials, parallel, lambda trial: run_trial(config, space, trial, parent, pruner, cpus, limit))
    finished = open_study(study_name, storage, sampler, pruner, space, seed)
    rows = log_sweep_summary(finished, parent["run_id"])
    counts = {state: sum(r["state"] == state for r in results) for state in ("complete", "pruned", "failed")}
    summary = {"experiment": parent["experiment"], "parent_run_id": parent["run_id"], "study": study_name, "storage": storage,
               "trials": results, "counts": counts, "earlier_trials": earlier, "table": rows}
    complete = [t for t in finished.trials if t.state.name == "COMPLETE" and "checkpoint" in t.user_attrs]
    if not complete:
        close_pipeline_run(parent, {f"trials_{k}": v for k, v in counts.items()}, {"champion": "none: no trial completed"})
        raise RuntimeError(f"sweep {study_name}: no trial completed ({counts}); see the trial runs' zhflow.failure tags")
    best = max(complete, key=lambda t: t.value)
    best_config = PipelineConfig.model_validate(best.user_attrs["config"])
    prepared = {"path": best.user_attrs["prepared"]}
    evaluated = evaluate_model(best_config, best.user_attrs["checkpoint"], prepared, parent, stage="evaluate")
    baseline = baseline_model(best_config, prepared, parent)
    chosen, candidates = choose_candidate(best_config, evaluated, prepared, parent)  # the best trial's model is "neural"
    model = register_model(best_config, chosen, prepared, parent, slot=slot["key"])
    metrics = ({k: v for k, v in chosen["metrics"].items() if k.startswith("test_")}
               | {f"{name}_{k}": v for name, c in candidates.items() for k, v in c["metrics"].items()
                  if k in ("test_macro_f1", "test_accuracy", "val_macro_f1")}
               | {f"baseline_{k}": v for k, v in baseline["metrics"].items()}
               | {f"trials_{k}": v for k, v in counts.items()} | {"best_val_macro_f1": best.value, "best_trial": best.number})
    close_pipeline_run(parent, metrics, {"model_version": model["version"], "alias": model["alias"], "best_trial": str(best.number),
                                         "optuna.study": study_name})
    return {**summary, "best": {"trial": best.number, "val_macro_f1": best.value, "params": best.params},
            "metrics": metrics, "selected": chosen["name"], "model": {k: model[k] for k in ("name", "version", "uri", "alias", "kind")}}
