"""Evaluation metrics (scikit-learn), their pictures, and one call that logs the whole evaluation to MLflow.

    import numpy as np, mlflow
    from training.metrics import log_evaluation
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7]])         # one column per label
    with mlflow.start_run():
        log_evaluation([0, 1, 0], probs, ["负面", "正面"], ["太差了", "很好", "还行"], "demo")
    # {'test_accuracy': 0.667, ..., 'test_roc_auc': 1.0, 'test_pr_auc': 1.0, 'test_texts': 3.0}
"""

from __future__ import annotations

import html
import tempfile
from pathlib import Path
from typing import Sequence

import mlflow
import numpy as np
import pandas as pd
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    classification_report,
    confusion_matrix,
    precision_recall_curve,
    precision_recall_fscore_support,
    roc_auc_score,
    roc_curve,
)


def classification_metrics(y_true: Sequence[int], y_pred: Sequence[int], prefix: str = "test_") -> dict[str, float]:
    """Accuracy and macro / micro / weighted precision, recall and F1."""
    out = {f"{prefix}accuracy": float(accuracy_score(y_true, y_pred))}
    for average in ("macro", "micro", "weighted"):
        p, r, f, _ = precision_recall_fscore_support(y_true, y_pred, average=average, zero_division=0)
        out.update({f"{prefix}{average}_precision": float(p), f"{prefix}{average}_recall": float(r), f"{prefix}{average}_f1": float(f)})
    return out


def per_class_report(y_true: Sequence[int], y_pred: Sequence[int], labels: list[str]) -> dict:
    return classification_report(
        y_true, y_pred, labels=list(range(len(labels))), target_names=labels, output_dict=True, zero_division=0
    )


def per_class_table(y_true: Sequence[int], y_pred: Sequence[int], labels: list[str]) -> pd.DataFrame:
    """One row per class, then ``macro avg`` and ``weighted avg``: label, precision, recall, f1, support."""
    report = per_class_report(y_true, y_pred, labels)
    rows = [{"label": name, "precision": report[name]["precision"], "recall": report[name]["recall"],
             "f1": report[name]["f1-score"], "support": int(report[name]["support"])}
            for name in [*labels, "macro avg", "weighted avg"]]
    return pd.DataFrame(rows)


def _pyplot(labels: list[str]) -> tuple[object, list[str]]:
    """pyplot with a CJK font when one is installed; else label names matplotlib can draw, or their indices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import font_manager

    try:
        from noto_cjk_sans_otc import FONT_PATH

        font_manager.fontManager.addfont(str(FONT_PATH))
        plt.rcParams["font.family"] = ["DejaVu Sans", "Noto Sans CJK SC"]  # per-glyph fallback
        return plt, labels
    except (ImportError, OSError, RuntimeError):
        if all(label.isascii() for label in labels):
            return plt, labels
        return plt, [f"{i}" for i in range(len(labels))]  # the index -> name table is per_class_report.json


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write as PNG and close (pyplot keeps every open figure in memory)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_confusion_matrix(y_true: Sequence[int], y_pred: Sequence[int], labels: list[str], path: str | Path, title: str) -> Path:
    """Raw counts and row-normalised shares side by side, as a PNG."""
    plt, names = _pyplot(labels)
    cm = confusion_matrix(y_true, y_pred, labels=list(range(len(labels))))
    norm = cm / np.clip(cm.sum(axis=1, keepdims=True), 1, None)
    size = max(4.0, 0.6 * len(labels) + 2.5)
    fig, axes = plt.subplots(1, 2, figsize=(2 * size + 1, size))
    for ax, data, fmt, name in ((axes[0], cm, "d", "counts"), (axes[1], norm, ".2f", "share of true label")):
        ax.imshow(data, cmap="Blues", vmin=0)
        ax.set_xticks(range(len(labels)), names, rotation=45, ha="right")
        ax.set_yticks(range(len(labels)), names)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        ax.set_title(name)
        threshold = data.max() / 2 if data.size else 0
        for i in range(len(labels)):
            for j in range(len(labels)):
                ax.text(j, i, format(data[i, j], fmt), ha="center", va="center",
                        color="white" if data[i, j] > threshold else "black")
    fig.suptitle(title)
    return save_figure(fig, path)


def binary_curves(y_true: Sequence[int], probs: np.ndarray, labels: list[str], path: str | Path, title: str) -> tuple[Path, dict]:
    """ROC and precision-recall curves side by side (positive class: ``labels[1]``), and their areas.

    ``probs`` has one column per label; any score that ranks texts works (probabilities or margins).
    The PR area is the average precision.

        png, areas = binary_curves([0, 1, 1], probs, ["negative", "positive"], "curves.png", "evaluate")
        areas  # {'roc_auc': 1.0, 'pr_auc': 1.0}
    """
    if len(labels) != 2:
        raise ValueError(f"ROC and PR curves need exactly two classes, got {len(labels)}: {', '.join(labels)}")
    positive = np.asarray(y_true) == 1
    if positive.all() or not positive.any():
        raise ValueError(f"ROC and PR curves need texts of both classes ({labels[0]!r} and {labels[1]!r})")
    scores = np.asarray(probs)[:, 1]
    areas = {"roc_auc": float(roc_auc_score(positive, scores)), "pr_auc": float(average_precision_score(positive, scores))}
    fpr, tpr, _ = roc_curve(positive, scores)
    precision, recall, _ = precision_recall_curve(positive, scores)
    plt, names = _pyplot(labels)
    fig, (roc, pr) = plt.subplots(1, 2, figsize=(10, 4.5))
    roc.plot(fpr, tpr, label=f"AUC {areas['roc_auc']:.4f}")
    roc.plot([0, 1], [0, 1], linestyle="--", color="grey", label="chance")
    roc.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC")
    pr.step(recall, precision, where="post", label=f"average precision {areas['pr_auc']:.4f}")
    pr.axhline(positive.mean(), linestyle="--", color="grey", label="chance")
    pr.set(xlabel="recall", ylabel="precision", title="precision-recall", ylim=(0, 1.02))
    for ax in (roc, pr):
        ax.legend(loc="lower right" if ax is roc else "lower left")
    fig.suptitle(f"{title} (positive class: {names[1]})")
    return save_figure(fig, path), areas


def confident_errors(texts: Sequence[str], y_true: Sequence[int], probs: np.ndarray, labels: list[str], k: int = 50) -> pd.DataFrame:
    """The ``k`` most confidently wrong predictions, most confident first.

    Columns: text, true, predicted, prob_predicted, prob_true.

        confident_errors(["很好", "太差"], [1, 0], np.array([[0.9, 0.1], [0.2, 0.8]]), ["neg", "pos"])
        #   text true predicted  prob_predicted  prob_true
        # 0   很好  pos       neg             0.9        0.1
        # 1   太差  neg       pos             0.8        0.2
    """
    probs = np.asarray(probs)
    y_true = np.asarray(y_true, dtype=int)
    y_pred = probs.argmax(1)
    rows = np.arange(len(y_true))
    frame = pd.DataFrame({
        "text": list(texts), "true": [labels[i] for i in y_true], "predicted": [labels[i] for i in y_pred],
        "prob_predicted": probs[rows, y_pred], "prob_true": probs[rows, y_true],
    })
    wrong = frame[y_pred != y_true]
    return wrong.sort_values("prob_predicted", ascending=False, kind="stable").head(k).reset_index(drop=True)


def _errors_html(errors: pd.DataFrame, title: str) -> str:
    table = errors.to_html(index=False, float_format="{:.4f}".format, border=0)
    summary = f"The {len(errors)} most confidently wrong predictions, most confident first." if len(errors) else "No wrong predictions."
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{padding:4px 8px;"
            "border-bottom:1px solid #ddd;text-align:left}</style></head>\n"
            f"<body><h1>{html.escape(title)}</h1><p>{summary}</p>\n{table}\n</body></html>\n")


def log_evaluation(
    y_true: Sequence[int],
    probs: np.ndarray,
    labels: list[str],
    texts: Sequence[str],
    title: str,
    prefix: str = "test_",
    model_id: str | None = None,
    dataset=None,
) -> dict[str, float]:
    """Log a whole evaluation into the active MLflow run and return its metrics.

    ``y_true`` holds indices into ``labels``; ``probs`` one column per label (scores that rank are enough
    for the curves). Metrics: those of :func:`classification_metrics`, ``{prefix}roc_auc`` and
    ``{prefix}pr_auc`` for two classes, ``{prefix}texts``; linked to ``model_id`` and ``dataset`` (an
    ``mlflow.data`` dataset) when given. Artifacts: per_class_report.json (a table), confusion_matrix.png,
    roc_pr_curves.png (two classes), errors.csv and errors.html (the most confidently wrong texts) and
    test_predictions.csv (text, true, predicted, prob_<label>).
    """
    probs = np.asarray(probs, dtype=np.float64)
    y_true = np.asarray(y_true, dtype=int)
    if probs.shape != (len(y_true), len(labels)):
        raise ValueError(f"probs has shape {probs.shape}; expected one row per text and one column per label "
                         f"({len(y_true)}, {len(labels)})")
    y_pred = probs.argmax(1)
    metrics = classification_metrics(y_true, y_pred, prefix=prefix)
    never = sorted(set(y_true.tolist()) - set(y_pred.tolist()))  # a class the model never gives (a rare one, often)
    metrics[f"{prefix}classes_never_predicted"] = float(len(never))
    if never:
        mlflow.set_tag(f"{prefix}classes_never_predicted", ", ".join(labels[i] for i in never)[:5000])
    heading = f"{title}: macro-F1 {metrics[f'{prefix}macro_f1']:.4f}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plot_confusion_matrix(y_true, y_pred, labels, folder / "confusion_matrix.png", heading)
        if len(labels) == 2 and len(set(y_true.tolist())) == 2:
            _, areas = binary_curves(y_true, probs, labels, folder / "roc_pr_curves.png", heading)
            metrics |= {f"{prefix}{key}": value for key, value in areas.items()}
        metrics[f"{prefix}texts"] = float(len(y_true))
        errors = confident_errors(texts, y_true, probs, labels)
        errors.to_csv(folder / "errors.csv", index=False, encoding="utf-8-sig")  # BOM: Excel reads the Chinese right
        (folder / "errors.html").write_text(_errors_html(errors, f"{title}: confident errors"), encoding="utf-8")
        predictions = pd.DataFrame({"text": list(texts), "true": [labels[i] for i in y_true],
                                    "predicted": [labels[i] for i in y_pred]}
                                   | {f"prob_{name}": probs[:, j] for j, name in enumerate(labels)})
        predictions.to_csv(folder / "test_predictions.csv", index=False, encoding="utf-8-sig")
        mlflow.log_artifacts(tmp)
    mlflow.log_table(per_class_table(y_true, y_pred, labels), "per_class_report.json")
    mlflow.log_metrics(metrics, model_id=model_id, dataset=dataset)
    return metrics
