"""Pruning tasks: rounds of prune + DDP fine-tune up to the target amount, then the before/after report.

MLflow: the ``prune`` stage run holds the before/after measurements and the trade-off plot; each round is
a run nested under it (``prune_round_1`` ...) with the round's sparsity, sizes, the validation macro-F1
right after pruning and the fine-tune's epochs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
from prefect import get_run_logger, task

from training.checkpoint import save_checkpoint
from training.config import PipelineConfig, flatten
from training.evaluate import load_model, split_macro_f1
from training.models import family_of
from training.measure import measure_checkpoint, plot_pruning_tradeoff
from training.prune import prune, sparsity
from tasks.tracking import close_pipeline_run, stage_run
from tasks.train import launch_worker

SUMMARY_KEYS = ("params", "nonzero_params", "sparsity_prunable", "file_bytes",
                "latency_b1_p50_ms", "latency_b1_p95_ms", "latency_b64_p50_ms", "latency_b64_p95_ms")


def _nonzero(model) -> int:
    """Parameters that are not exactly zero (a structured prune removes them, an unstructured one zeroes them)."""
    return sum(int((p != 0).sum()) for p in model.parameters())


def _val_macro_f1(model, cfg, prepared: dict, config: PipelineConfig) -> float:
    return split_macro_f1(model, cfg, prepared["path"], "val", config.preprocess.max_len, config.evaluate.batch_size)


@task(name="prune-round")
def prune_round(config: PipelineConfig, checkpoint: str, prepared: dict, prune_parent: dict, round_no: int, amount: float,
                cpus: int | None = None, gpus: list[int] | None = None) -> dict:
    """Prune ``checkpoint`` to the cumulative ``amount``, fine-tune it with the DDP worker (on ``cpus`` cores, default
    all), measure the result."""
    p = config.prune
    stage = f"prune_round_{round_no}"
    out = Path(prune_parent["work_dir"]) / stage
    with stage_run(prune_parent, stage) as run:
        mlflow.log_params({"prune.method": p.method, "prune.round": round_no, "prune.round_amount": round(amount, 6)})
        model, cfg, state = load_model(checkpoint)
        val_before = _val_macro_f1(model, cfg, prepared, config)
        kept_before = _nonzero(model)
        model, new_cfg = prune(model, cfg, p.method, amount, p.include_embedding, reference=config.model)
        removed = kept_before - _nonzero(model)
        mlflow.log_metric("removed_params", removed)
        if removed == 0:  # already sparser than asked (a fastText table's unseen rows are zeros): nothing to fine-tune
            get_run_logger().warning(
                "round %d: %s to %.0f%% removed no weight: the model's prunable weights were already %.1f%% zeros; "
                "the model goes on unchanged (raise prune.amount above that to prune it)", round_no, p.method,
                100 * amount, 100 * sparsity(model, p.include_embedding)["sparsity_prunable"])
            return {"checkpoint": checkpoint, "best_val_macro_f1": val_before, "finetuned": False, "removed": 0,
                    "round": round_no, "amount": amount, "run_id": run.info.run_id, "val_macro_f1_after_prune": val_before,
                    "model_config": cfg.model_dump(), "measured": None}
        val_pruned = _val_macro_f1(model, new_cfg, prepared, config)
        pruned = out / "pruned.pt"
        save_checkpoint(pruned, {**state, "model": model.state_dict(), "model_config": new_cfg.model_dump(),
                                 "sizes": family_of(new_cfg).sizes_of(model, state["sizes"]),
                                 "metrics": {"val_macro_f1": val_pruned}})
        mlflow.log_metrics({"val_macro_f1_before_prune": val_before, "val_macro_f1_after_prune": val_pruned})
        result = {"checkpoint": str(pruned), "best_val_macro_f1": val_pruned, "finetuned": False}
        if p.finetune_epochs:
            train_cfg = config.train.model_copy(update={"epochs": p.finetune_epochs, "lr": p.finetune_lr,
                                                        "patience": p.finetune_epochs})
            tuned = launch_worker(stage, config, prepared, run.info.run_id, out / "finetune", train=train_cfg, model=new_cfg,
                                  init_checkpoint=str(pruned), keep_sparsity=p.method != "structured", cpus=cpus, gpus=gpus,
                                  epochs_setting="prune.finetune_epochs")
            # scored here as the pruned model was (the worker validates in train.precision: bf16 on CUDA)
            tuned_model, tuned_cfg, _ = load_model(tuned["best_checkpoint"])
            val_tuned = _val_macro_f1(tuned_model, tuned_cfg, prepared, config)
            result = {"checkpoint": tuned["best_checkpoint"], "best_val_macro_f1": val_tuned, "finetuned": True}
            if val_tuned < val_pruned:  # every fine-tuning epoch worse than none: keep the pruned model
                get_run_logger().warning(
                    "round %d: fine-tuning lowered validation macro-F1 (%.4f pruned, at best %.4f fine-tuned, "
                    "prune.finetune_lr %g): the round keeps the pruned model without it", round_no, val_pruned,
                    val_tuned, p.finetune_lr)
                mlflow.set_tag("finetune_discarded", "fine-tuning lowered validation macro-F1; the pruned model is kept")
                result = {"checkpoint": str(pruned), "best_val_macro_f1": val_pruned, "finetuned": False,
                          "finetune_discarded": True}
            mlflow.log_metric("finetune_kept", float(result["finetuned"]))
        measured = measure_checkpoint(result["checkpoint"], prepared["path"], config.preprocess.max_len, p.latency_threads)
        mlflow.log_metrics(measured | {"val_macro_f1": result["best_val_macro_f1"]})
        get_run_logger().info(
            "round %d: %s to %.0f%%: sparsity %.3f, %d parameters, %.0f kB, val macro-F1 %.4f -> %.4f pruned -> %.4f %s",
            round_no, p.method, 100 * amount, measured["sparsity_prunable"], measured["params"], measured["file_bytes"] / 1e3,
            val_before, val_pruned, result["best_val_macro_f1"],
            "fine-tuned" if result["finetuned"] else "kept (no fine-tuning)",
        )
        return {**result, "removed": removed, "round": round_no, "amount": amount, "run_id": run.info.run_id, "val_macro_f1_after_prune": val_pruned,
                "model_config": new_cfg.model_dump(), "measured": {k: measured[k] for k in SUMMARY_KEYS}}


@task(name="prune-report")
def prune_report(config: PipelineConfig, trained: dict, evaluated_trained: dict, rounds: list[dict], evaluated: dict,
                 prepared: dict, prune_parent: dict) -> dict:
    """Before/after measurements of the final model against the trained one, the trade-off plot; closes the prune run."""
    p = config.prune
    # both measured here, back to back, so that the latency ratio holds on a busy machine; without rounds the final
    # model is the trained one, measured once (timing a pretrained encoder twice cost minutes for a ratio of 1)
    run_ids = [r["run_id"] for r in rounds]
    rounds = [r for r in rounds if r["removed"]]  # a round that removed nothing left the model as it was
    checkpoints = [trained["best_checkpoint"]] + ([evaluated["checkpoint"]] if rounds else [])
    measured = [{k: m[k] for k in SUMMARY_KEYS} for m in (
        measure_checkpoint(ckpt, prepared["path"], config.preprocess.max_len, p.latency_threads) for ckpt in checkpoints)]
    before, after = measured[0], measured[-1]
    f1_before, f1_after = evaluated_trained["metrics"]["test_macro_f1"], evaluated["metrics"]["test_macro_f1"]
    metrics = ({f"before_{k}": v for k, v in before.items()} | {f"after_{k}": v for k, v in after.items()} | {
        "test_macro_f1_before": f1_before, "test_macro_f1_after": f1_after, "test_macro_f1_change": f1_after - f1_before,
        "removed_params": before["nonzero_params"] - after["nonzero_params"],
        "file_size_ratio": before["file_bytes"] / after["file_bytes"],
        "params_ratio": before["params"] / after["params"],
        "speedup_b1": before["latency_b1_p50_ms"] / after["latency_b1_p50_ms"],
        "speedup_b64": before["latency_b64_p50_ms"] / after["latency_b64_p50_ms"],
    })
    client = mlflow.MlflowClient()
    for key, value in flatten(p, "prune.").items():
        client.log_param(prune_parent["run_id"], key, value)
    if rounds:
        points = [(0.0, trained["best_val_macro_f1"], before["latency_b64_p50_ms"], before["file_bytes"])] + [
            (r["amount"], r["best_val_macro_f1"], r["measured"]["latency_b64_p50_ms"], r["measured"]["file_bytes"]) for r in rounds]
        with tempfile.TemporaryDirectory() as tmp:
            png = plot_pruning_tradeoff(points, Path(tmp) / "pruning_tradeoff.png", f"{p.method} pruning, {len(rounds)} round(s)")
            client.log_artifact(prune_parent["run_id"], str(png))
    close_pipeline_run.fn(prune_parent, metrics, {"method": p.method, "skipped": str(not rounds).lower()},
                          artifact_key="prune-metrics")
    speedup = metrics["speedup_b64"]  # below 1: slower (unstructured pruning keeps every weight's multiply)
    pace = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    get_run_logger().info("%s pruning to %.0f%%: test macro-F1 %.4f -> %.4f, file %.2fx smaller, batch 64 %s",
                          p.method, 100 * p.amount, f1_before, f1_after, metrics["file_size_ratio"], pace)
    return {"run_id": prune_parent["run_id"], "metrics": metrics, "rounds": run_ids}
