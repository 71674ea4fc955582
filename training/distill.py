"""Knowledge distillation (Hinton, Vinyals and Dean, 2015): a teacher's class probabilities teach a student.

    loss = alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross-entropy(student, label)

``teacher_T`` are the teacher's probabilities softened at temperature ``T`` (``p ** (1 / T)``, renormalised: the same
as dividing its logits by ``T``), ``student_T`` the student's softmax of ``logits / T``; ``T^2`` keeps the soft term's
gradients on the scale of the hard one's as ``T`` grows. The KL divergence differs from the cross-entropy with the
soft targets by the teacher's entropy, a constant: the same gradients, and a loss that is 0 when they agree.

A teacher is anything that gives class probabilities for the student's training texts, one row per row of the
prepared train split (augmented copies included: they are part of the transfer set):

- a zhflow checkpoint (the run's own trained model), served as it would be (raw strings in, read with its own
  vocabulary or tokenizer: a fine-tuned encoder teaches a jieba-word student, and a student whose folder has other
  vocabularies, augmented copies in its train split, reads the same texts);
- :func:`baseline_teacher`: TF-IDF character 1-3 grams + logistic regression fitted on the train split only, its
  probabilities for the train texts out-of-fold (scikit-learn's ``cross_val_predict``): a model's probabilities for
  the very texts it was fitted on are mostly its memory of their labels, and teach little beyond them;
- :func:`pyfunc_teacher`: any MLflow model whose ``predict`` returns ``prob_<label>`` columns, on raw strings (the
  checkpoint above goes through it too).

    from training.distill import baseline_teacher, kd_loss
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from training.config import DistillError

PROB_PREFIX = "prob_"


def soften(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """Probabilities at temperature ``temperature``: ``softmax(log(p) / T)``."""
    return torch.softmax(torch.log(probs.clamp_min(1e-12)) / temperature, dim=1)


def kd_loss(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float, alpha: float,
            weight: torch.Tensor | None = None, label_smoothing: float = 0.0) -> torch.Tensor:
    """The distillation loss of one batch (see the module); rows with ``label < 0`` (no label) get the soft term only."""
    t = temperature
    soft = F.kl_div(F.log_softmax(logits / t, dim=1), soften(teacher, t), reduction="batchmean") * (t * t)
    if alpha >= 1.0:
        return soft
    labelled = labels >= 0
    if not bool(labelled.any()):
        hard = logits.sum() * 0.0
    else:
        hard = F.cross_entropy(logits[labelled], labels[labelled], weight=weight, label_smoothing=label_smoothing)
    return alpha * soft + (1.0 - alpha) * hard


class WithTeacher(Dataset):
    """A split whose batches carry the teacher's probabilities of their rows: ``(inputs, labels, teacher_probs)``."""

    def __init__(self, split, probs: np.ndarray):
        if len(probs) != len(split):
            raise DistillError(f"the teacher's probabilities have {len(probs)} rows; the train split has {len(split)}")
        self.split = split
        self.labels = split.labels
        self.probs = torch.from_numpy(np.ascontiguousarray(probs, dtype=np.float32))

    def __len__(self) -> int:
        return len(self.split)

    def lengths(self) -> np.ndarray:
        return self.split.lengths()

    def __getitem__(self, i: int):
        return self.split[i], i

    def collate(self, batch: list) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        inputs, labels = self.split.collate([item for item, _ in batch])
        return inputs, labels, self.probs[[i for _, i in batch]]


def transfer_texts(prepared_dir: str | Path, split: str = "train") -> pd.DataFrame:
    """The split's rows as teachers read them: ``text`` (as the user wrote it; an augmented copy, which has no original,
    its tokens joined), ``clean``, ``augmented``."""
    frame = pd.read_json(Path(prepared_dir) / f"{split}.jsonl", lines=True, dtype=False)
    augmented = frame["augmented"].fillna(False).astype(bool) if "augmented" in frame else pd.Series(False, index=frame.index)
    joined = frame["clean"].astype(str).str.replace(" ", "", regex=False)  # an augmented copy: tokens joined by spaces
    return pd.DataFrame({"text": np.where(augmented, joined, frame["text"].astype(str)),
                         "clean": np.where(augmented, joined, frame["clean"].astype(str)), "augmented": augmented})


BASELINE_TEACHER_C = (1.0, 10.0, 100.0)


def baseline_teacher(prepared_dir: str | Path, labels: np.ndarray, num_classes: int, folds: int = 5, seed: int = 13,
                     c_values: tuple[float, ...] = BASELINE_TEACHER_C):
    """Probabilities of TF-IDF character 1-3 grams + logistic regression for every train row: out-of-fold for the
    texts of the split (``C`` chosen by out-of-fold log-loss), from the fit on all of them for augmented copies (new
    texts to it). No fit ever sees the validation or test split. Also: what was chosen, for MLflow, and the fit on
    all the split's texts (what scores the teacher on validation and test)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline

    def model(c: float):
        return make_pipeline(TfidfVectorizer(analyzer="char", ngram_range=(1, 3), sublinear_tf=True, min_df=2),
                             LogisticRegression(C=c, max_iter=2000))

    rows = transfer_texts(prepared_dir)
    texts = rows["clean"].tolist()
    original = ~rows["augmented"].to_numpy() & (labels >= 0)  # unlabelled texts, like augmented copies: new to it
    x, y = [t for t, o in zip(texts, original) if o], labels[original]
    smallest = int(np.bincount(y, minlength=num_classes).min())
    if smallest < 2:
        raise DistillError(f"the baseline teacher's cross-fitting needs at least 2 train texts of each class; "
                           f"the train split has {smallest} of one")
    folds = max(2, min(folds, smallest))
    cv = StratifiedKFold(folds, shuffle=True, random_state=seed)
    best = None
    for c in c_values:
        oof = cross_val_predict(model(c), x, y, cv=cv, method="predict_proba")
        loss = float(log_loss(y, oof, labels=list(range(num_classes))))
        if best is None or loss < best[0]:
            best = (loss, c, oof)
    loss, c, oof = best
    fitted = model(c).fit(x, y)
    probs = np.zeros((len(texts), num_classes))
    probs[original] = oof
    if (~original).any():
        probs[~original] = fitted.predict_proba([t for t, o in zip(texts, original) if not o])
    info = {"C": c, "folds": folds, "oof_log_loss": loss, "oof_accuracy": float((oof.argmax(1) == y).mean())}
    return probs.astype(np.float32), info, fitted


def served_labels(columns) -> list[str]:
    """The class labels of a served model's output columns (``prob_<label>``)."""
    return [str(c)[len(PROB_PREFIX):] for c in columns if str(c).startswith(PROB_PREFIX)]


def check_teacher_labels(teacher: str, theirs: list[str], ours: list[str]) -> None:
    if sorted(theirs) != sorted(ours):
        raise DistillError(f"distill.teacher {teacher}: its labels {sorted(theirs)} are not this data's labels {sorted(ours)}")


def pyfunc_teacher(predict: Callable[[pd.DataFrame], pd.DataFrame], teacher: str, texts: list[str], labels: list[str],
                   batch_size: int = 1024, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """A served model's probabilities for ``texts``, its columns put in this data's label order; ``progress(n)`` after
    each batch of ``n`` texts."""
    out = []
    for start in range(0, len(texts), batch_size):
        frame = predict(pd.DataFrame({"text": texts[start:start + batch_size]}))
        check_teacher_labels(teacher, served_labels(frame.columns), labels)
        out.append(frame[[f"{PROB_PREFIX}{label}" for label in labels]].to_numpy(dtype=np.float64))
        if progress is not None:
            progress(len(frame))
    probs = np.concatenate(out) if out else np.zeros((0, len(labels)))
    if not np.isfinite(probs).all() or (probs < 0).any():
        raise DistillError(f"distill.teacher {teacher}: its prob_ columns are not probabilities (negative or not finite)")
    sums = probs.sum(1, keepdims=True)
    if (sums <= 0).any():
        raise DistillError(f"distill.teacher {teacher}: some rows' probabilities sum to 0")
    return (probs / sums).astype(np.float32)
