"""The MLflow pyfunc model: raw Chinese strings in, label and class probabilities out.

Cleaning, segmentation, stop words, vocabulary and weights all travel inside
the logged model, so a user needs nothing but the model URI:

    import mlflow
    model = mlflow.pyfunc.load_model("models:/zhflow-classifier@champion")
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
from training.evaluate import load_model
from training.models import min_input_len, model_inputs
from training.text.clean import normalizer
from training.text.segment import Segmenter

INPUT_COLUMN = "text"


class TextClassifier(mlflow.pyfunc.PythonModel):
    """Artifacts: ``checkpoint`` (best.pt), its sidecar, ``vocab`` / ``char_vocab``, ``meta`` (labels, preprocessing)."""

    # predict takes a list, a Series or a DataFrame on purpose: no type-hint wrapper converting every input to one
    # type (MLflow's own switch for that, which also stops its advice to add type hints at import)
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        meta = json.loads(Path(context.artifacts["meta"]).read_text(encoding="utf-8"))
        self.labels: list[str] = meta["labels"]
        # the user's dictionary and stop-word files travel as artifacts: point the settings at those copies
        files = {key: context.artifacts[key] for key in ("user_dict", "stopwords_file") if key in context.artifacts}
        self.pre = PreprocessConfig.model_validate(meta["preprocess"] | files)
        self.normalize = normalizer(self.pre)
        self.segmenter = Segmenter.from_config(self.pre)
        self.chars = Segmenter("char", "none")
        self.model, self.model_cfg, _ = load_model(context.artifacts["checkpoint"])
        self.model.eval()
        self.inputs = model_inputs(self.model_cfg)
        self.stoi = {}
        for name, key in (("word", "vocab"), ("char", "char_vocab")):
            if name in self.inputs:
                vocab = json.loads(Path(context.artifacts[key]).read_text(encoding="utf-8"))
                self.stoi[name] = {tok: i for i, tok in enumerate(vocab)}
        self.limits = {"word": self.pre.max_len, "char": self.model_cfg.max_char_len}
        self.min_len = min_input_len(self.model_cfg)

    def _encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        clean = [self.normalize(t) for t in texts]
        batch = {}
        for name in self.inputs:
            tokenizer = self.segmenter if name == "word" else self.chars
            stoi, unk = self.stoi[name], self.stoi[name][UNK]
            rows = [[stoi.get(t, unk) for t in tokenizer.tokenize(c)][: self.limits[name]] for c in clean]
            ids = torch.zeros(len(rows), max([self.min_len] + [len(r) for r in rows]), dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            batch[name] = ids
        return batch

    def predict_proba(self, texts: list[str], batch_size: int = 256) -> np.ndarray:
        out = []
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                logits = self.model(self._encode(texts[start : start + batch_size]))
                out.append(torch.softmax(logits, dim=1).numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self.labels)))

    def predict(self, context, model_input, params=None) -> pd.DataFrame:
        texts = _as_texts(model_input)
        probs = self.predict_proba(texts)
        frame = pd.DataFrame({"label": [self.labels[i] for i in probs.argmax(1)] if len(texts) else []})
        for j, name in enumerate(self.labels):
            frame[f"prob_{name}"] = probs[:, j].astype(np.float64) if len(texts) else []
        return frame


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
    return ["" if v is None else str(v) for v in values]
