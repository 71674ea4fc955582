"""What a linear model reaches on fastText's own feature vectors: each text's token and n-gram weights as the encoders
weigh them (``model.idf``, ``model.sublinear_tf``, ``model.min_df``, ``model.input``; every input side by side, each
over its own norm), fitted with scikit-learn's LinearSVC (C 0.5, as the reference) and logistic regression (C 4),
beside the run's TF-IDF + linear SVM reference, on zhflow's own split of each dataset (the default preset's
preprocessing):

    python -m bench.feature_probe law-names-300 --seeds 13 1 2 3 --set model.sublinear_tf=true --set model.min_df=2

Prints validation / test macro-F1 per split and the mean. The fastText model trained with those settings is a linear
map of the same vectors (its tables times its classifier): the fits here compare feature choices at the reference's
penalty, not a bound on the trained model (its factored tables and early stopping regularise it otherwise). A probe
for choosing the neural default's features (not part of ``python -m bench``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.svm import LinearSVC
from torch.utils.data import DataLoader

from bench.datasets import BUILDERS, dataset
from training.baseline import fit_baseline
from training.data.prepare import prepare_dataset
from training.evaluate import open_split
from training.linear import split_inputs
from training.models import family_of
from training.models.fasttext import _feature_rows
from training.overrides import apply_overrides
from training.presets import preset


def probe(name: str, seed: int, work: Path, sets: list[str]) -> dict[str, tuple[float, float]]:
    cfg = apply_overrides(preset("default"), [f"data.dataset={dataset(name)}", f"data.seed={seed}", *sets]
                          + (["data.max_samples=8000"] if name == "law-articles" else []))
    out = work / f"{name}-{seed}"
    manifest = prepare_dataset(cfg.data, cfg.preprocess, out, progress=False)
    family = family_of(cfg.model)
    sizes = family.sizes(manifest, cfg.model, cfg.preprocess.max_len)
    model = family.build(cfg.model, sizes, len(manifest["labels"]))
    splits = {s: open_split(out, s, cfg.model, cfg.preprocess.max_len, sizes) for s in ("train", "val", "test")}
    family.fit(model, cfg.model.model_copy(update={"init": "zeros"}), splits["train"])  # the idf weights only

    def rows(split):
        x, y = _feature_rows(model, DataLoader(split, batch_size=512, collate_fn=split.collate))
        return sp.hstack([x[k] for k in model.encoders], format="csr"), y

    (xt, yt), (xv, yv), (xs, ys) = rows(splits["train"]), rows(splits["val"]), rows(splits["test"])
    train, val, test = (split_inputs(out, s) for s in ("train", "val", "test"))
    svm = fit_baseline(train.clean, train.labels)
    scores = {"TF-IDF + linear SVM (the run's reference)": (f1_score(val.labels, svm.predict(val.clean), average="macro"),
                                                           f1_score(test.labels, svm.predict(test.clean), average="macro"))}
    for label, classifier in (("LinearSVC C=0.5 on fastText's features", LinearSVC(C=0.5)),
                              ("logistic regression C=4 on fastText's features",
                               LogisticRegression(C=4, max_iter=1000))):
        classifier.fit(xt, yt)
        scores[label] = (f1_score(yv, classifier.predict(xv), average="macro"),
                         f1_score(ys, classifier.predict(xs), average="macro"))
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="*", default=["law-names-300"], choices=list(BUILDERS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[13])
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    rows: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets:
            for seed in args.seeds:
                started = time.monotonic()
                scores = probe(name, seed, Path(tmp), args.sets)
                print(f"{name}, split {seed} ({time.monotonic() - started:.0f} s): "
                      + ", ".join(f"{k} {v:.4f} / {t:.4f}" for k, (v, t) in scores.items()), flush=True)
                for key, value in scores.items():
                    rows.setdefault(key, {}).setdefault(name, []).append(value)
    print(f"\n| model (validation / test macro-F1, mean of splits {', '.join(map(str, args.seeds))}; "
          f"{' '.join(args.sets) or 'the default preset'}) | " + " | ".join(args.datasets) + " |")
    print("|---|" + "---|" * len(args.datasets))
    for key, by_name in rows.items():
        print(f"| {key} | " + " | ".join(f"{np.mean([v for v, _ in by_name[n]]):.4f} / {np.mean([t for _, t in by_name[n]]):.4f}"
                                         for n in args.datasets) + " |")


if __name__ == "__main__":
    main()
