"""Choosing among a run's candidates (neural, linear, ensemble) on the validation split only.

The test split never enters a choice here: it only scores what was chosen.

    w, f1 = choose_weight(neural_val, linear_val, val_labels)      # share of the neural model in the average
    honest = cross_fitted_f1(neural_val, linear_val, val_labels)   # what the weight's choice is worth on unseen texts
    pick({"neural": 0.81, "linear": 0.84, "ensemble": 0.85})       # -> "ensemble"

Every candidate's validation score is the best of the choices made on validation for it: the neural model's epoch,
the linear model's features and C, the ensemble's weight. The ensemble's weights include 0 and 1, the two models
themselves, so it is never below either on validation; where it only equals one, that model is picked (a tie goes to
the first listed, and the ensemble comes last). Scored cross-fitted instead, the ensemble competed handicapped
against scores chosen in-sample: on 10,000 news headlines (the three within 0.2 points on validation) the pipeline
registered the neural model, 1.7 points of test macro-F1 under the ensemble (BENCHMARKS.md, 2026-12-03).
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import f1_score

CANDIDATES = ("neural", "linear", "ensemble")
WEIGHTS = np.round(np.linspace(0.0, 1.0, 21), 2)  # steps of 0.05


def _macro_f1(labels: np.ndarray, probs: np.ndarray) -> float:
    return float(f1_score(labels, probs.argmax(1), average="macro"))


def choose_weight(neural: np.ndarray, linear: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """The neural model's weight in ``w * neural + (1 - w) * linear`` with the best macro-F1 on these (validation)
    probabilities; ties go to the weight nearest an even average. Returns ``(w, macro-F1)``."""
    scored = [(_macro_f1(labels, w * neural + (1 - w) * linear), -abs(w - 0.5), float(w)) for w in WEIGHTS]
    f1, _, w = max(scored)
    return w, f1


def cross_fitted_f1(neural: np.ndarray, linear: np.ndarray, labels: np.ndarray, seed: int = 13) -> float:
    """The ensemble's validation macro-F1 with each half of the split scored at the weight chosen on the other half.

    Choosing the weight on the same texts it is scored on would make the ensemble never worse than either model on
    validation, so it would always be picked; this score carries no such advantage.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    halves = (order[: len(order) // 2], order[len(order) // 2:])
    predicted = np.empty(len(labels), dtype=np.int64)
    for fit, score in (halves, halves[::-1]):
        w, _ = choose_weight(neural[fit], linear[fit], labels[fit])
        predicted[score] = (w * neural[score] + (1 - w) * linear[score]).argmax(1)
    return float(f1_score(labels, predicted, average="macro"))


def pick(val_scores: dict[str, float]) -> str:
    """The candidate with the best validation macro-F1; on a tie the first in ``val_scores``' order."""
    best = max(val_scores.values())
    return next(name for name, score in val_scores.items() if score == best)
