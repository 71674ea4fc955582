"""Sweeps: the same 8 trials with and without the pruner (epochs spent, best validation macro-F1), and the
champion's test macro-F1 against the TF-IDF + linear SVM baseline on the same split.

Both sweeps run the real ``sweep`` flow (Prefect, torchrun, MLflow in a throwaway store) with the built-in
space and the same sampler seeds, one trial at a time, so they try the same settings in the same order
until the pruner stops one: the difference is the pruner's alone.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.common import verdict
from training.config import apply_overrides, preset

TRIALS = 8


def _sweep(config, pruner: str, tmp: Path, trials: int) -> dict:
    from flows.sweep import sweep

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / pruner / 'mlflow.db'}"
    os.environ["ZHFLOW_HOME"] = str(tmp / pruner / "home")
    (tmp / pruner).mkdir(parents=True, exist_ok=True)
    import mlflow

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    return sweep(config=config, trials=trials, pruner=pruner, parallel=1, study=f"bench-{pruner}", seed=13,
                 experiment="bench-sweep")


def run(quick: bool, repeats: int) -> str:
    from prefect.testing.utilities import prefect_test_harness

    trials = 2 if quick else TRIALS
    config = preset("tiny") if quick else apply_overrides(preset("default"), ["data.max_samples=4000"])
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from the temporary server
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "ZHFLOW_HOME")}
    try:
        with tempfile.TemporaryDirectory() as tmp_name, prefect_test_harness(server_startup_timeout=120):
            tmp = Path(tmp_name)
            full = _sweep(config, "none", tmp, trials)
            pruned = _sweep(config, "median", tmp, trials)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def epochs(summary: dict) -> int:
        return sum(row["epochs"] or 0 for row in summary["table"])

    rows = []
    for name, s in (("without pruner", full), ("median pruner", pruned)):
        rows.append(f"| {name} | {s['counts']['complete']} / {s['counts']['pruned']} / {s['counts']['failed']} | {epochs(s)} | "
                    f"{s['best']['val_macro_f1']:.4f} (trial {s['best']['trial']}) | {s['metrics']['test_macro_f1']:.4f} | "
                    f"{s['metrics']['baseline_test_macro_f1']:.4f} |")
    share = epochs(pruned) / max(1, epochs(full))
    gap = 100 * (full["best"]["val_macro_f1"] - pruned["best"]["val_macro_f1"])
    margin = 100 * (pruned["metrics"]["test_macro_f1"] - pruned["metrics"]["baseline_test_macro_f1"])
    def cells(row: dict) -> str:
        value = "" if row["best_val_macro_f1"] is None else f"{row['best_val_macro_f1']:.4f}"
        return f"{row['state']} | {row['epochs']} | {value}"

    def settings(row: dict) -> str:
        skip = ("trial", "state", "epochs", "seconds", "best_val_macro_f1")
        return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k not in skip)

    per_trial = "\n".join(f"| {a['trial']} | {cells(a)} | {cells(b)} | {settings(a)} |" for a, b in zip(full["table"], pruned["table"]))
    data = "the tiny preset (600 texts)" if quick else "4,000 texts of the built-in corpus (default preset, deduplicated)"
    return "\n".join([
        "## Sweeps",
        "",
        f"Two {trials}-trial sweeps of the `sweep` flow with the built-in search space on {data}, TPE with the same "
        "seeds, one trial at a time: without a pruner, and with the median pruner (a trial stops when its validation "
        "macro-F1 after an epoch is below the median of the finished trials at that epoch). Then the best trial's model "
        "is scored on the test split beside the TF-IDF + linear SVM baseline trained on the same train split.",
        "",
        "| sweep | complete / pruned / failed | epochs spent | best val macro-F1 | champion test macro-F1 | baseline test macro-F1 |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"- Epochs: the pruned sweep spent {epochs(pruned)} of the {epochs(full)} epochs of the full one ({100 * share:.0f}%; "
        f"target at most 60%: {verdict(share <= 0.6)}); its best validation macro-F1 is {gap:.2f} points below the best full "
        f"trial's (target within 0.5: {verdict(gap <= 0.5)}).",
        f"- Champion against the baseline on the same test split: {margin:+.2f} points "
        f"(target: above it: {verdict(margin > 0)}).",
        "",
        "| trial | full: state | epochs | val macro-F1 | pruned: state | epochs | val macro-F1 | settings |",
        "|---|---|---|---|---|---|---|---|",
        per_trial,
        "",
    ])
