"""Pruning task: global L1 on the trained model, measured before and after."""

from __future__ import annotations

from pathlib import Path

import mlflow
from prefect import get_run_logger, task
from sklearn.metrics import f1_score

from training.checkpoint import save_checkpoint
from training.config import PipelineConfig, flatten
from training.evaluate import load_model, open_split, predict_proba
from training.models import min_input_len
from training.prune import global_l1_prune, sparsity
from tasks.tracking import stage_run


def _val_macro_f1(model, prepared: dict, cfg: PipelineConfig) -> float:
    val = open_split(prepared["path"], "val", cfg.model, cfg.preprocess.max_len)
    probs = predict_proba(model, val, cfg.evaluate.batch_size, min_input_len(cfg.model))
    return float(f1_score(val.labels, probs.argmax(1), average="macro"))


@task(name="prune")
def prune_model(config: PipelineConfig, trained: dict, prepared: dict, parent: dict) -> dict:
    p = config.prune
    with stage_run(parent, "prune") as run:
        mlflow.log_params(flatten(p, "prune."))
        model, _, state = load_model(trained["best_checkpoint"])
        before = sparsity(model, p.include_embedding)
        val_before = _val_macro_f1(model, prepared, config)
        global_l1_prune(model, p.amount, p.include_embedding)
        after = sparsity(model, p.include_embedding)
        val_after = _val_macro_f1(model, prepared, config)
        mlflow.log_metrics({f"before_{k}": v for k, v in before.items() if not k.startswith("sparsity.")}
                           | {f"after_{k}": v for k, v in after.items()}
                           | {"val_macro_f1_before_prune": val_before, "val_macro_f1_after_prune": val_after})
        out = Path(parent["work_dir"]) / "prune" / "pruned.pt"
        save_checkpoint(out, {**state, "model": model.state_dict(), "metrics": {"val_macro_f1": val_after}})
        get_run_logger().info(
            "pruned %.0f%% of prunable weights (global L1): sparsity %.3f -> %.3f, val macro-F1 %.4f -> %.4f before fine-tuning",
            100 * p.amount, before["sparsity_prunable"], after["sparsity_prunable"], val_before, val_after,
        )
        return {"checkpoint": str(out), "run_id": run.info.run_id,
                "sparsity_before": before["sparsity_prunable"], "sparsity_after": after["sparsity_prunable"]}
