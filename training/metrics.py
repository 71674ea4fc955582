"""Evaluation metrics (scikit-learn) and the confusion-matrix picture."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    classification_report,
    confusion_matrix,
    precision_recall_fscore_support,
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
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
