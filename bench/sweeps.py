"""Sweeps: the same trials with and without the pruner, for several sampler seeds (epochs spent, best validation macro-F1), and the
champion's test macro-F1 against the TF-IDF + linear SVM baseline on the same split.

Both sweeps run the real ``sweep`` flow (Prefect, torchrun, MLflow in a throwaway store) with the built-in
space and the same sampler seeds, one trial at a time, so they try the same settings in the same order
until the pruner stops one: the difference is the pruner's alone.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from bench import common
from bench.common import verdict
from training.overrides import apply_overrides
from training.presets import preset

TRIALS = 5
TEXTS = 1500


def _sweep(config, pruner: str, tmp: Path, trials: int, seed: int) -> dict:
    from flows.sweep import sweep

    home = tmp / f"{pruner}-{seed}"
    home.mkdir(parents=True, exist_ok=True)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    os.environ["ZHFLOW_HOME"] = str(home / "home")
    import mlflow

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    return sweep(config=config, trials=trials, pruner=pruner, parallel=1, study=f"bench-{pruner}-{seed}", seed=seed,
                 experiment="bench-sweep")


def _epochs(summary: dict) -> int:
    return sum(row["epochs"] or 0 for row in summary["table"])


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} (range {format(min(values), fmt)} to {format(max(values), fmt)})"


def _keep_champion(pairs: list, config) -> None:
    """The best trial of all these sweeps (by validation macro-F1), for the quality section."""
    seed, pruner, s = max(((seed, name, s) for seed, *both in pairs for name, s in zip(("none", "median"), both)),
                          key=lambda item: item[2]["best"]["val_macro_f1"])
    common.SWEEP_CHAMPION.parent.mkdir(parents=True, exist_ok=True)
    common.SWEEP_CHAMPION.write_text(json.dumps({
        "params": s["best"]["params"], "val_macro_f1": s["best"]["val_macro_f1"], "trial": s["best"]["trial"],
        "seed": seed, "pruner": pruner, "sweeps": 2 * len(pairs), "trials": len(s["table"]),
        "texts": config.data.max_samples}, indent=2), encoding="utf-8")


def run(quick: bool, repeats: int) -> str:
    from prefect.testing.utilities import prefect_test_harness

    trials = 2 if quick else TRIALS
    # a sweep seeds trial k's sampler with seed + k: seeds 100 apart never share a trial's suggestions
    seeds = [13 + 100 * i for i in range(1 if quick else max(1, repeats))]
    config = preset("tiny") if quick else apply_overrides(preset("default"), [f"data.max_samples={TEXTS}"])
    if common.SMOKE:
        config = apply_overrides(config, ["data.max_samples=200", "train.epochs=2", "prune.finetune_epochs=0"])
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from the temporary server
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "ZHFLOW_HOME")}
    pairs = []
    try:
        with tempfile.TemporaryDirectory() as tmp_name, prefect_test_harness(server_startup_timeout=120):
            for seed in seeds:  # each seed: the same suggestions with and without the pruner, one after the other
                pairs.append((seed, _sweep(config, "none", Path(tmp_name), trials, seed),
                              _sweep(config, "median", Path(tmp_name), trials, seed)))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    if not quick:  # the quality section trains these settings again on the full deduplicated split
        _keep_champion(pairs, config)
    rows, shares, gaps, margins = [], [], [], []
    for seed, full, pruned in pairs:
        for name, s in (("without pruner", full), ("median pruner", pruned)):
            rows.append(f"| {seed} | {name} | {s['counts']['complete']} / {s['counts']['pruned']} / {s['counts']['failed']} | "
                        f"{_epochs(s)} | {s['best']['val_macro_f1']:.4f} (trial {s['best']['trial']}) | "
                        f"{s['metrics']['test_macro_f1']:.4f} | {s['metrics']['baseline_test_macro_f1']:.4f} |")
        shares.append(_epochs(pruned) / max(1, _epochs(full)))
        gaps.append(100 * (full["best"]["val_macro_f1"] - pruned["best"]["val_macro_f1"]))
        margins.append(100 * (pruned["metrics"]["test_macro_f1"] - pruned["metrics"]["baseline_test_macro_f1"]))
    share, gap, margin = statistics.median(shares), statistics.median(gaps), statistics.median(margins)

    def cells(row: dict) -> str:
        value = "" if row["best_val_macro_f1"] is None else f"{row['best_val_macro_f1']:.4f}"
        return f"{row['state']} | {row['epochs']} | {value}"

    def settings(row: dict) -> str:
        skip = ("trial", "state", "epochs", "seconds", "best_val_macro_f1")
        return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k not in skip)

    seed, full, pruned = pairs[0]
    per_trial = "\n".join(f"| {a['trial']} | {cells(a)} | {cells(b)} | {settings(a)} |" for a, b in zip(full["table"], pruned["table"]))
    data = ("the tiny preset (600 texts)" if quick else
            f"{TEXTS:,} texts of the built-in corpus (default preset, deduplicated)")
    return "\n".join([
        "## Sweeps",
        "",
        f"For each of {len(seeds)} sampler seeds ({', '.join(map(str, seeds))}: trial k of a sweep uses seed + k, so "
        f"these never share a trial), two {trials}-trial sweeps of the `sweep` flow with the built-in search "
        f"space on {data}, TPE, one trial at a time: without a pruner, and with the median pruner (a trial stops when its "
        "validation macro-F1 after an epoch is below the median of the finished trials at that epoch). With the same seed "
        "both sweeps try the same settings in the same order until the pruner stops one. Then the best trial's model is "
        "scored on the test split beside the TF-IDF + linear SVM baseline trained on the same train split.",
        "",
        "| seed | sweep | complete / pruned / failed | epochs spent | best val macro-F1 | champion test macro-F1 | baseline test macro-F1 |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- Epochs: the pruned sweep spent {_spread([100 * x for x in shares], '.0f')}% of the epochs of the full one "
        f"(median over seeds; target at most 60%: {verdict(share <= 0.6)}).",
        f"- Best validation macro-F1 of the pruned sweep below the full one's: {_spread(gaps, '.2f')} points "
        f"(target within 0.5: {verdict(gap <= 0.5)}).",
        f"- The pruned sweep's champion against the baseline on the same test split: {_spread(margins, '+.2f')} points "
        f"(target: above it: {verdict(margin > 0)}).",
        "",
        f"Trials of seed {seed}:",
        "",
        "| trial | full: state | epochs | val macro-F1 | pruned: state | epochs | val macro-F1 | settings |",
        "|---|---|---|---|---|---|---|---|",
        per_trial,
        "",
    ])
