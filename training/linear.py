"""The ``linear`` family: TF-IDF over character 1-3 grams (and word 1-2 grams), then a linear classifier.

Fitted in the pipeline's own process on the train split (no torchrun). Chosen on the validation split: whether word
n-grams help, the classifier (logistic regression, or a linear SVM whose margins become probabilities through a softmax
with a temperature fitted on validation log-loss) and its regularisation ``C``. Saved as plain files, no pickle: the
vocabularies and settings as JSON, idf and coefficients as ``.npy``; :meth:`LinearModel.load` rebuilds the same
scikit-learn objects, so the probabilities are identical.

    from training.linear import LinearModel, fit_linear, split_inputs
    train, val = split_inputs(prepared_dir, "train"), split_inputs(prepared_dir, "val")
    model, val_scores = fit_linear(train, val, num_classes=2, c_values={"logreg": [4, 16], "svm": [0.5]})
    model = refit(model, merge(train, val))      # the chosen settings, fitted on train + val
    model.save("linear/")
    LinearModel.load("linear/").predict_proba(["质量很好"], [["质量", "很", "好"]])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.svm import LinearSVC
from scipy.special import log_softmax, softmax

SEP = "\x1f"  # joins a text's word tokens: no token contains it (normalisation removes control characters)
FORMAT_VERSION = 2  # 1: logistic regression only (still loaded)
CLASSIFIERS = ("logreg", "svm")
TEMPERATURES = np.logspace(-1, 2.5, 71)  # tried for the SVM's softmax; the one with the lowest validation log-loss is kept


def _split_tokens(joined: str) -> list[str]:
    return joined.split(SEP) if joined else []


# the vectorizers' settings, as saved; the word analyzer's tokenizer is code, added back on load
CHAR_PARAMS = {"analyzer": "char", "ngram_range": [1, 3], "sublinear_tf": True, "min_df": 2, "lowercase": False,
               "dtype": "float64"}
WORD_PARAMS = {"analyzer": "word", "ngram_range": [1, 2], "sublinear_tf": True, "min_df": 2, "lowercase": False,
               "token_pattern": None, "dtype": "float64"}


def _vectorizer(params: dict, vocabulary: dict | None = None) -> TfidfVectorizer:
    kwargs = dict(params, ngram_range=tuple(params["ngram_range"]), dtype=np.dtype(params["dtype"]))
    if params["analyzer"] == "word":
        kwargs["tokenizer"] = _split_tokens
    return TfidfVectorizer(**kwargs, vocabulary=vocabulary)


@dataclass
class SplitInputs:
    """What the linear family reads of one split: cleaned texts, their word tokens (as in the prepared vocabulary,
    rare ones as ``<unk>``) and label indices. Augmented copies are left out: they are token lists, not texts."""

    clean: list[str]
    tokens: list[list[str]]
    labels: np.ndarray


def split_inputs(prepared_dir: str | Path, split: str) -> SplitInputs:
    root = Path(prepared_dir)
    rows = pd.read_json(root / f"{split}.jsonl", lines=True, dtype=False)
    vocab = json.loads((root / "vocab.json").read_text(encoding="utf-8"))
    ids, offsets = np.load(root / f"{split}.ids.npy"), np.load(root / f"{split}.offsets.npy")
    labels = np.load(root / f"{split}.labels.npy")
    keep = ~rows["augmented"].fillna(False).astype(bool).to_numpy() if "augmented" in rows else np.ones(len(rows), bool)
    index = np.flatnonzero(keep)
    tokens = [[vocab[t] for t in ids[offsets[i]:offsets[i + 1]]] for i in index]
    return SplitInputs([rows["clean"].iloc[i] for i in index], tokens, labels[index])


def _margins(classifier: LinearSVC, x: sp.csr_matrix) -> np.ndarray:
    margins = classifier.decision_function(x)
    return np.column_stack([np.zeros_like(margins), margins]) if margins.ndim == 1 else margins  # two classes: one margin


def fit_temperature(margins: np.ndarray, labels: np.ndarray) -> float:
    """The factor on the margins whose softmax has the lowest log-loss on these labels (smallest on ties)."""
    rows = np.arange(len(labels))
    losses = [-log_softmax(margins * t, axis=1)[rows, labels].mean() for t in TEMPERATURES]
    return float(TEMPERATURES[int(np.argmin(losses))])


class LinearModel:
    """Fitted vectorizers (``word`` None: character n-grams only) and classifier; ``classes`` are label indices.
    ``temperature`` is set for the SVM (its probabilities are ``softmax(temperature * margins)``), None otherwise."""

    def __init__(self, char: TfidfVectorizer, word: TfidfVectorizer | None, classifier: LogisticRegression | LinearSVC,
                 c: float, temperature: float | None = None):
        self.char, self.word, self.classifier, self.c, self.temperature = char, word, classifier, c, temperature

    @property
    def features_name(self) -> str:
        return "char" if self.word is None else "char+word"

    @property
    def classifier_name(self) -> str:
        return "svm" if isinstance(self.classifier, LinearSVC) else "logreg"

    @property
    def setting(self) -> str:
        """How :func:`fit_linear` names this model's settings, e.g. ``char+word svm C=0.5``."""
        return f"{self.features_name} {self.classifier_name} C={self.c:g}"

    @property
    def n_features(self) -> int:
        return len(self.char.vocabulary_) + (len(self.word.vocabulary_) if self.word is not None else 0)

    def features(self, clean: Sequence[str], tokens: Sequence[Sequence[str]]) -> sp.csr_matrix:
        parts = [self.char.transform(list(clean))]
        if self.word is not None:
            parts.append(self.word.transform([SEP.join(t) for t in tokens]))
        return sp.hstack(parts, format="csr")

    def _proba(self, x: sp.csr_matrix) -> np.ndarray:
        if self.temperature is None:
            return self.classifier.predict_proba(x)
        return softmax(_margins(self.classifier, x) * self.temperature, axis=1)

    def predict_proba(self, clean: Sequence[str], tokens: Sequence[Sequence[str]]) -> np.ndarray:
        if not len(clean):
            return np.zeros((0, len(self.classifier.classes_)))
        return self._proba(self.features(clean, tokens))

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"format_version": FORMAT_VERSION, "classifier": self.classifier_name, "C": self.c,
                "temperature": self.temperature, "classes": [int(c) for c in self.classifier.classes_],
                "char": {"params": CHAR_PARAMS, "vocabulary": {t: int(i) for t, i in self.char.vocabulary_.items()}},
                "word": None if self.word is None else
                {"params": WORD_PARAMS, "vocabulary": {t: int(i) for t, i in self.word.vocabulary_.items()}}}
        (folder / "linear.json").write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        np.save(folder / "char_idf.npy", self.char.idf_)
        if self.word is not None:
            np.save(folder / "word_idf.npy", self.word.idf_)
        np.save(folder / "coef.npy", self.classifier.coef_)
        np.save(folder / "intercept.npy", self.classifier.intercept_)
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "LinearModel":
        folder = Path(folder)
        meta = json.loads((folder / "linear.json").read_text(encoding="utf-8"))
        if meta.get("format_version") not in (1, FORMAT_VERSION):
            raise ValueError(f"{folder}: linear model format {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
        char = _vectorizer(meta["char"]["params"], meta["char"]["vocabulary"])
        char.idf_ = np.load(folder / "char_idf.npy", allow_pickle=False)
        word = None
        if meta["word"] is not None:
            word = _vectorizer(meta["word"]["params"], meta["word"]["vocabulary"])
            word.idf_ = np.load(folder / "word_idf.npy", allow_pickle=False)
        name = meta.get("classifier", "logreg")
        if name not in CLASSIFIERS:
            raise ValueError(f"{folder}/linear.json: unknown classifier {name!r}; expected one of {', '.join(CLASSIFIERS)}")
        classifier = LogisticRegression(C=meta["C"]) if name == "logreg" else LinearSVC(C=meta["C"])
        classifier.classes_ = np.asarray(meta["classes"])
        classifier.coef_ = np.load(folder / "coef.npy", allow_pickle=False)
        classifier.intercept_ = np.load(folder / "intercept.npy", allow_pickle=False)
        return cls(char, word, classifier, meta["C"], meta.get("temperature"))


def _classifier(name: str, c: float, class_weight: str | None, max_iter: int) -> LogisticRegression | LinearSVC:
    if name == "logreg":
        return LogisticRegression(C=c, max_iter=max_iter, class_weight=class_weight)
    return LinearSVC(C=c, max_iter=max_iter, class_weight=class_weight)


def fit_linear(train: SplitInputs, val: SplitInputs, num_classes: int, c_values: dict[str, Sequence[float]],
               class_weight: str | None = "balanced",
               max_iter: int = 2000) -> tuple[LinearModel, dict[str, float]]:
    """Fit character n-grams alone and with word n-grams, each classifier of ``c_values`` (``{"logreg": [C, ...],
    "svm": [C, ...]}``) once per ``C`` on each; keep the one with the best validation macro-F1 (ties: fewer features,
    then logistic regression, then the smaller, more regularised C). Returns the model and
    ``{"char logreg C=4": val macro-F1, ...}`` (:attr:`LinearModel.setting` names the kept one); the grid comes
    from ``LinearConfig.grid()``."""
    unknown = set(c_values) - set(CLASSIFIERS)
    if unknown:
        raise ValueError(f"unknown linear classifier(s) {', '.join(sorted(unknown))}; expected {', '.join(CLASSIFIERS)}")
    char, word = _vectorizer(CHAR_PARAMS), _vectorizer(WORD_PARAMS)
    x_char = char.fit_transform(train.clean)
    x_word = word.fit_transform([SEP.join(t) for t in train.tokens])
    scores, best, best_score = {}, None, -1.0
    for vectors in ((char, None), (char, word)):
        probe = LinearModel(*vectors, LogisticRegression(), 0.0)
        x_train = x_char if vectors[1] is None else sp.hstack([x_char, x_word], format="csr")
        x_val = probe.features(val.clean, val.tokens)
        for name in (n for n in CLASSIFIERS if n in c_values):
            for c in sorted(c_values[name]):
                classifier = _classifier(name, c, class_weight, max_iter).fit(x_train, train.labels)
                if len(classifier.classes_) != num_classes:
                    raise ValueError(f"the train split holds {len(classifier.classes_)} of {num_classes} classes")
                # kept (and saved) in float32: half the size for many classes; scored as saved, so a loaded copy is identical
                classifier.coef_ = classifier.coef_.astype(np.float32)
                model = LinearModel(*vectors, classifier, c)
                score = scores[model.setting] = float(f1_score(val.labels, classifier.predict(x_val), average="macro"))
                if score > best_score:
                    best, best_score = model, score
    if best.classifier_name == "svm":
        best.temperature = fit_temperature(_margins(best.classifier, best.features(val.clean, val.tokens)), val.labels)
    return best, scores


def merge(*splits: SplitInputs) -> SplitInputs:
    """The splits' texts, tokens and labels in one."""
    return SplitInputs([t for s in splits for t in s.clean], [t for s in splits for t in s.tokens],
                       np.concatenate([s.labels for s in splits]))


def refit(model: LinearModel, data: SplitInputs, class_weight: str | None = "balanced",
          max_iter: int = 2000) -> LinearModel:
    """The same settings (features, classifier, C, temperature) fitted anew on ``data``: after the choice on the
    validation split, train and validation together give the final model more to learn from."""
    char = _vectorizer(CHAR_PARAMS)
    parts = [char.fit_transform(data.clean)]
    word = None
    if model.word is not None:
        word = _vectorizer(WORD_PARAMS)
        parts.append(word.fit_transform([SEP.join(t) for t in data.tokens]))
    classifier = _classifier(model.classifier_name, model.c, class_weight, max_iter)
    classifier.fit(sp.hstack(parts, format="csr"), data.labels)
    if len(classifier.classes_) != len(model.classifier.classes_):
        raise ValueError(f"refit: {len(classifier.classes_)} of {len(model.classifier.classes_)} classes")
    classifier.coef_ = classifier.coef_.astype(np.float32)
    return LinearModel(char, word, classifier, model.c, model.temperature)
