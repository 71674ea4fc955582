"""The MLflow pyfunc model: raw Chinese strings in, label and class probabilities out.

Cleaning, segmentation, stop words, vocabulary and weights all travel inside
the logged model, so a user needs nothing but the model URI:

    import mlflow
    model = mlflow.pyfunc.load_model("models:/zhflow-snownlp-sentiment@champion")
    model.predict(["这本书非常好看，值得一读", "质量太差了，很失望"])
    #      label  prob_negative  prob_positive
    # 0  positive          0.03           0.97
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch

from training.config import PreprocessConfig
from training.data.vocab import UNK
from training.evaluate import autocast, load_model, serving_copy
from training.linear import LinearModel
from training.models import family_of
from training.text.clean import normalizer
from training.text.segment import Segmenter

INPUT_COLUMN = "text"


class TextClassifier(mlflow.pyfunc.PythonModel):
    """One served model for every candidate the pipeline registers (``meta["kind"]``):

    - ``neural``: artifacts ``checkpoint`` (best.pt) and its sidecar, ``vocab`` / ``char_vocab``;
    - ``linear``: the folder ``linear`` (training.linear, plain JSON and .npy) and ``vocab``;
    - ``ensemble``: both, the probabilities averaged with ``meta["weight"]`` on the neural model.

    ``meta`` also holds the labels and the preprocessing settings (normalisation and segmentation run inside).
    """

    # predict takes a list, a Series or a DataFrame on purpose: no type-hint wrapper converting every input to one
    # type (MLflow's own switch for that, which also stops its advice to add type hints at import)
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        artifacts = context.artifacts
        meta = json.loads(Path(artifacts["meta"]).read_text(encoding="utf-8"))
        self.labels: list[str] = meta["labels"]
        self.kind: str = meta.get("kind", "neural")
        self.weight: float = meta.get("weight", 1.0 if self.kind == "neural" else 0.0)
        self.precision: str = meta.get("precision", "fp32")  # bf16 where the CPU runs it faster and it agrees with fp32
        # the user's dictionary and stop-word files travel as artifacts: point the settings at those copies
        files = {key: artifacts[key] for key in ("user_dict", "stopwords_file") if key in artifacts}
        self.pre = PreprocessConfig.model_validate(meta["preprocess"] | files)
        self.normalize = normalizer(self.pre)
        self.segmenter = Segmenter.from_config(self.pre)
        self.model = self.linear = self.encoder = None
        self.word_stoi: dict[str, int] = {}
        if self.kind in ("neural", "ensemble"):
            self.model, self.model_cfg, state = load_model(artifacts["checkpoint"])
            self.model.eval()
            # the family says how raw text becomes the model's batch (zhflow's vocabularies, or its own tokenizer)
            self.encoder = family_of(self.model_cfg).text_encoder(self.model_cfg, state["sizes"], artifacts,
                                                                  self.pre.max_len, self.segmenter)
        if self.kind in ("linear", "ensemble"):
            self.linear = LinearModel.load(artifacts["linear"])
            self.word_stoi = _stoi(artifacts["vocab"])

    def _serving(self) -> tuple[torch.nn.Module, str]:
        """The model that predicts under ``self.precision`` (bf16: a bf16 copy of the weights, made once)."""
        if self.precision != "bf16":
            return self.model, self.precision
        if getattr(self, "_bf16", None) is None:
            self._bf16 = serving_copy(self.model, "bf16")
        return self._bf16

    def _words(self, clean: list[str]) -> list[list[str]]:
        """Word tokens as the prepared vocabulary holds them (tokens it lacks as <unk>)."""
        stoi = self.word_stoi
        return [[t if t in stoi else UNK for t in self.segmenter.tokenize(c)] for c in clean]

    def predict_proba(self, texts: list[str], batch_size: int = 256) -> np.ndarray:
        """One row of class probabilities per text, in order; batched longest texts first, so that each batch is
        padded to about its own texts' length."""
        order = np.argsort([-len(t) for t in texts], kind="stable")
        texts = [texts[i] for i in order]
        out = []
        for start in range(0, len(texts), batch_size):
            clean = [self.normalize(t) for t in texts[start : start + batch_size]]
            words = None
            if self.linear is not None:  # segmented once, for the linear model and a word-input neural model
                words = self._words(clean)
            probs = 0.0
            if self.model is not None:
                if words is None and self.encoder.needs_words:
                    words = [self.segmenter.tokenize(c) for c in clean]
                model, precision = self._serving()
                with torch.no_grad(), autocast(precision, torch.device("cpu")):
                    logits = model(self.encoder(clean, words))
                probs = self.weight * torch.softmax(logits.float(), dim=1).numpy().astype(np.float64)
            if self.linear is not None:
                probs = probs + (1.0 - self.weight) * self.linear.predict_proba(clean, words)
            out.append(probs)
        if not out:
            return np.zeros((0, len(self.labels)))
        probs = np.empty_like(merged := np.concatenate(out))
        probs[order] = merged
        return probs

    def predict(self, context, model_input, params=None) -> pd.DataFrame:
        texts = _as_texts(model_input)
        probs = self.predict_proba(texts)
        frame = pd.DataFrame({"label": [self.labels[i] for i in probs.argmax(1)] if len(texts) else []})
        for j, name in enumerate(self.labels):
            frame[f"prob_{name}"] = probs[:, j].astype(np.float64) if len(texts) else []
        return frame


def _stoi(vocab_file: str) -> dict[str, int]:
    return {tok: i for i, tok in enumerate(json.loads(Path(vocab_file).read_text(encoding="utf-8")))}


def _as_texts(model_input) -> list[str]:
    if isinstance(model_input, pd.DataFrame):
        column = INPUT_COLUMN if INPUT_COLUMN in model_input.columns else model_input.columns[0]
        values = model_input[column].tolist()
    elif isinstance(model_input, (pd.Series, np.ndarray, list, tuple)):
        values = list(model_input)
    elif isinstance(model_input, str):
        values = [model_input]
    else:
        raise TypeError(f"expected a column of strings, got {type(model_input).__name__}")
    # a missing value (JSON null arrives as None, or as NaN in a column pandas made numeric) is a blank text, not "nan"
    return ["" if v is None or v is pd.NA or (isinstance(v, float) and v != v) else str(v) for v in values]


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AMX or AVX-512 bf16); elsewhere bf16 autocast is emulated and slow."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def serving_precision(classifier: TextClassifier, texts: list[str], min_agreement: float = 0.995,
                      min_speedup: float = 1.1) -> tuple[str, dict[str, float]]:
    """bf16 for the served neural model of a family that serves it (the pretrained one) when the CPU has it, its labels agree with fp32's on ``texts`` (at least
    ``min_agreement``) and it is at least ``min_speedup`` faster on them; else fp32. The measurements, for MLflow."""
    import time

    if classifier.model is None or not texts or not family_of(classifier.model_cfg).serves_bf16 or not cpu_has_bf16():
        return "fp32", {}
    timings, probs = {}, {}
    for precision in ("fp32", "bf16", "fp32", "bf16"):  # interleaved, the second round counts
        classifier.precision = precision
        started = time.perf_counter()
        probs[precision] = classifier.predict_proba(texts, batch_size=64)
        timings[precision] = time.perf_counter() - started
    agreement = float((probs["fp32"].argmax(1) == probs["bf16"].argmax(1)).mean())
    speedup = timings["fp32"] / timings["bf16"]
    chosen = "bf16" if agreement >= min_agreement and speedup >= min_speedup else "fp32"
    classifier.precision = chosen
    return chosen, {"serving_bf16_agreement": agreement, "serving_bf16_speedup": speedup,
                    "serving_bf16_max_prob_diff": float(np.abs(probs["fp32"] - probs["bf16"]).max())}
