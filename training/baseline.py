"""The reference every neural model is held against: TF-IDF character 1-3 grams + a linear SVM.

It reads the same cleaned texts (the prepared splits' ``clean`` field) and the same train split as
the neural model; no segmentation, no vocabulary, no GPU.

    from training.baseline import class_scores, fit_baseline
    model = fit_baseline(["质量很好", "内容精彩", "太差了", "很失望"] * 2, [1, 1, 0, 0] * 2)
    class_scores(model, ["很好看", "太失望了"])   # one column per class, in model.classes_ order
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.special import softmax
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.svm import LinearSVC

BASELINE_NAME = "tfidf_char_1_3_linear_svc"
BASELINE_PARAMS = {"analyzer": "char", "ngram_range": "1-3", "sublinear_tf": True, "min_df": 2, "C": 0.5}


def tfidf_svm() -> Pipeline:
    """An unfitted TF-IDF (character 1-3 grams, sublinear tf, min_df 2) + LinearSVC(C=0.5) pipeline."""
    return make_pipeline(TfidfVectorizer(analyzer="char", ngram_range=(1, 3), sublinear_tf=True, min_df=2), LinearSVC(C=0.5))


def fit_baseline(train_texts: Sequence[str], train_labels: Sequence) -> Pipeline:
    """:func:`tfidf_svm` fitted on the texts; labels can be indices or names."""
    return tfidf_svm().fit(list(train_texts), list(train_labels))


def class_scores(model: Pipeline, texts: Sequence[str]) -> np.ndarray:
    """Scores in [0, 1], one column per class in ``model.classes_`` order, each row summing to 1.

    A softmax of the SVM margins (for two classes, a sigmoid of the one margin): uncalibrated scores,
    NOT probabilities. They rank texts the same way the margins do, which is all the ROC / PR curves
    and the confident-error list use; the argmax is the SVM's own prediction.
    """
    margins = model.decision_function(list(texts))
    if margins.ndim == 1:  # two classes: one margin, positive towards classes_[1]
        margins = np.column_stack([np.zeros_like(margins), margins])
    return softmax(margins, axis=1)
