"""What the fastText shape can reach as a linear model, outside the worker: the factored model (char 1-3 gram TF-IDF
features -> 64 dimensions -> classes, the tables' and the classifier's shape) trained with Adam, full batch for 300
epochs by default (``--batch``, ``--epochs``), no early stopping, with cross-entropy or the multi-class hinge loss,
with or without an L2 penalty on every row of both factors in the loss (on a product of two factors it acts as a
trace-norm penalty on the linear map) or AdamW's decoupled decay instead, beside the run's TF-IDF + linear SVM
reference, on zhflow's own split of each dataset (the default preset's preprocessing):

    python -m bench.factored_probe law-names-300 thucnews-headlines --seeds 13 1 2 3
    python -m bench.factored_probe law-names-300 --seeds 13 1 2 3 --batch 32 --epochs 50

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

VARIANTS = (("cross-entropy", 0.0, 0.0), ("cross-entropy", 1e-4, 0.0), ("cross-entropy", 0.0, 1.0), ("hinge", 0.0, 0.0),
            ("hinge", 1e-4, 0.0))  # (loss, L2 penalty in the loss, AdamW's decoupled decay)


def _sparse(x) -> torch.Tensor:
    x = x.tocoo()
    return torch.sparse_coo_tensor(np.vstack([x.row, x.col]), x.data.astype(np.float32), x.shape,
                                   check_invariants=False).coalesce()


def factored(x_train, y_train: np.ndarray, x_test, classes: int, loss: str, l2: float, decay: float = 0.0,
             dim: int = 64, epochs: int = 300, lr: float = 1e-2, batch: int = 0, seed: int = 0) -> np.ndarray:
    """Test predictions of the factored linear model trained on ``x_train`` (rows: TF-IDF vectors), full batch or in
    shuffled batches of ``batch`` rows; ``l2``: a penalty on every row of both factors, added to each step's loss;
    ``decay``: AdamW's decoupled weight decay instead."""
    generator = torch.Generator().manual_seed(seed)
    x_test, y = _sparse(x_test), torch.tensor(y_train)
    tables = (torch.randn(x_train.shape[1], dim, generator=generator) * 0.01).requires_grad_()
    classifier = (torch.randn(dim, classes, generator=generator) / dim ** 0.5).requires_grad_()
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.AdamW([tables, classifier, bias], lr=lr, weight_decay=decay)
    n = x_train.shape[0]
    batches = [(_sparse(x_train), y)] if not batch else None
    for _ in range(epochs):
        if batch:
            order = torch.randperm(n, generator=generator).numpy()
            batches = [(_sparse(x_train[order[i:i + batch]]), y[order[i:i + batch]]) for i in range(0, n, batch)]
        for x, labels in batches:
            optimizer.zero_grad()
            logits = torch.sparse.mm(x, tables) @ classifier + bias
            value = F.cross_entropy(logits, labels) if loss == "cross-entropy" else F.multi_margin_loss(logits, labels)
            (value + l2 * ((tables ** 2).sum() + (classifier ** 2).sum()) / 2).backward()
            optimizer.step()
    with torch.no_grad():
        return (torch.sparse.mm(x_test, tables) @ classifier + bias).argmax(1).numpy()


def probe(name: str, seed: int, work: Path, batch: int = 0, epochs: int = 300) -> dict[str, float]:
    cfg = apply_overrides(preset("default"), [f"data.dataset={dataset(name)}", f"data.seed={seed}"]
                          + (["data.max_samples=8000"] if name == "law-articles" else []))
    out = work / f"{name}-{seed}"
    manifest = prepare_dataset(cfg.data, cfg.preprocess, out, progress=False)
    train, test = split_inputs(out, "train"), split_inputs(out, "test")
    svm = fit_baseline(train.clean, train.labels)
    scores = {"SVM reference": f1_score(test.labels, svm.predict(test.clean), average="macro")}
    vectorizer = svm.steps[0][1]
    x_train, x_test = vectorizer.transform(train.clean), vectorizer.transform(test.clean)
    for loss, l2, decay in VARIANTS:
        predicted = factored(x_train, train.labels, x_test, len(manifest["label_map"]), loss, l2, decay, epochs=epochs,
                             batch=batch, seed=seed)
        label = f"{loss}" + (f", L2 {l2:g}" if l2 else "") + (f", AdamW decay {decay:g}" if decay else "")
        scores[label] = f1_score(test.labels, predicted, average="macro")
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="*", default=["law-names-300", "thucnews-headlines"], choices=list(BUILDERS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[13])
    parser.add_argument("--batch", type=int, default=0, help="rows a step (0: the whole train split)")
    parser.add_argument("--epochs", type=int, default=300)
    args = parser.parse_args()
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets:
            for seed in args.seeds:
                started = time.monotonic()
                scores = probe(name, seed, Path(tmp), args.batch, args.epochs)
                print(f"{name}, split {seed} ({time.monotonic() - started:.0f} s): "
                      + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)
                for key, value in scores.items():
                    rows.setdefault(key, {}).setdefault(name, []).append(value)
    how = f"batches of {args.batch}" if args.batch else "full batch"
    print(f"\n| model (test macro-F1, mean of splits {', '.join(map(str, args.seeds))}; {how}, {args.epochs} epochs) | "
          + " | ".join(args.datasets) + " |")
    print("|---|" + "---|" * len(args.datasets))
    for key, by_name in rows.items():
        print(f"| {key} | " + " | ".join(f"{np.mean(by_name[n]):.4f}" for n in args.datasets) + " |")


if __name__ == "__main__":
    main()
