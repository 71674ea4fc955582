"""What the fastText shape can reach as a linear model, outside the worker: the factored model (char 1-3 gram TF-IDF
features -> 64 dimensions -> classes, the tables' and the classifier's shape) trained full batch with Adam for 300
epochs, no early stopping, with cross-entropy or the multi-class hinge loss, with or without an L2 penalty on both
factors (on a product of two factors it acts as a trace-norm penalty on the linear map), beside the run's TF-IDF +
linear SVM reference, on zhflow's own split of each dataset (the default preset's preprocessing):

    python -m bench.factored_probe law-names-300 thucnews-headlines --seeds 13 1 2 3

Prints a markdown table of test macro-F1. A probe for choosing the neural default's objective (not part of
``python -m bench``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import f1_score

from bench.datasets import BUILDERS, dataset
from training.baseline import fit_baseline
from training.data.prepare import prepare_dataset
from training.linear import split_inputs
from training.overrides import apply_overrides
from training.presets import preset

VARIANTS = (("cross-entropy", 0.0), ("cross-entropy", 1e-4), ("hinge", 0.0), ("hinge", 1e-4))


def _sparse(x) -> torch.Tensor:
    x = x.tocoo()
    return torch.sparse_coo_tensor(np.vstack([x.row, x.col]), x.data.astype(np.float32), x.shape,
                                   check_invariants=False).coalesce()


def factored(x_train, y_train: np.ndarray, x_test, classes: int, loss: str, l2: float, dim: int = 64,
             epochs: int = 300, lr: float = 1e-2, seed: int = 0) -> np.ndarray:
    """Test predictions of the factored linear model trained full batch on ``x_train`` (rows: TF-IDF vectors)."""
    generator = torch.Generator().manual_seed(seed)
    x_train, x_test, y = _sparse(x_train), _sparse(x_test), torch.tensor(y_train)
    tables = (torch.randn(x_train.shape[1], dim, generator=generator) * 0.01).requires_grad_()
    classifier = (torch.randn(dim, classes, generator=generator) / dim ** 0.5).requires_grad_()
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.Adam([tables, classifier, bias], lr=lr)
    for _ in range(epochs):
        optimizer.zero_grad()
        logits = torch.sparse.mm(x_train, tables) @ classifier + bias
        value = F.cross_entropy(logits, y) if loss == "cross-entropy" else F.multi_margin_loss(logits, y)
        (value + l2 * ((tables ** 2).sum() + (classifier ** 2).sum()) / 2).backward()
        optimizer.step()
    with torch.no_grad():
        return (torch.sparse.mm(x_test, tables) @ classifier + bias).argmax(1).numpy()


def probe(name: str, seed: int, work: Path) -> dict[str, float]:
    cfg = apply_overrides(preset("default"), [f"data.dataset={dataset(name)}", f"data.seed={seed}"]
                          + (["data.max_samples=8000"] if name == "law-articles" else []))
    out = work / f"{name}-{seed}"
    manifest = prepare_dataset(cfg.data, cfg.preprocess, out, progress=False)
    train, test = split_inputs(out, "train"), split_inputs(out, "test")
    svm = fit_baseline(train.clean, train.labels)
    scores = {"SVM reference": f1_score(test.labels, svm.predict(test.clean), average="macro")}
    vectorizer = svm.steps[0][1]
    x_train, x_test = vectorizer.transform(train.clean), vectorizer.transform(test.clean)
    for loss, l2 in VARIANTS:
        predicted = factored(x_train, train.labels, x_test, len(manifest["label_map"]), loss, l2, seed=seed)
        scores[f"{loss}, L2 {l2:g}"] = f1_score(test.labels, predicted, average="macro")
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="*", default=["law-names-300", "thucnews-headlines"], choices=list(BUILDERS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[13])
    args = parser.parse_args()
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets:
            for seed in args.seeds:
                started = time.monotonic()
                scores = probe(name, seed, Path(tmp))
                print(f"{name}, split {seed} ({time.monotonic() - started:.0f} s): "
                      + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)
                for key, value in scores.items():
                    rows.setdefault(key, {}).setdefault(name, []).append(value)
    print(f"\n| model (test macro-F1, mean of splits {', '.join(map(str, args.seeds))}) | " + " | ".join(args.datasets) + " |")
    print("|---|" + "---|" * len(args.datasets))
    for key, by_name in rows.items():
        print(f"| {key} | " + " | ".join(f"{np.mean(by_name[n]):.4f}" for n in args.datasets) + " |")


if __name__ == "__main__":
    main()
