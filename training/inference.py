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

from training.checkpoint import load_checkpoint
from training.config import ModelConfig, PreprocessConfig
from training.data.vocab import UNK
from training.models import build_model, min_input_len
from training.text.clean import normalizer
from training.text.segment import Segmenter

INPUT_COLUMN = "text"


class TextClassifier(mlflow.pyfunc.PythonModel):
    """Artifacts: ``checkpoint`` (best.pt), its sidecar, ``vocab`` (vocab.json), ``meta`` (labels, preprocessing)."""

    def load_context(self, context) -> None:
        meta = json.loads(Path(context.artifacts["meta"]).read_text(encoding="utf-8"))
        self.labels: list[str] = meta["labels"]
        # the user's dictionary and stop-word files travel as artifacts: point the settings at those copies
        files = {key: context.artifacts[key] for key in ("user_dict", "stopwords_file") if key in context.artifacts}
        self.pre = PreprocessConfig.model_validate(meta["preprocess"] | files)
        vocab = json.loads(Path(context.artifacts["vocab"]).read_text(encoding="utf-8"))
        self.stoi = {tok: i for i, tok in enumerate(vocab)}
        self.normalize = normalizer(self.pre)
        self.segmenter = Segmenter.from_config(self.pre)
        state = load_checkpoint(context.artifacts["checkpoint"])
        self.model_cfg = ModelConfig.model_validate(state["model_config"])
        self.model = build_model(self.model_cfg, state["vocab_size"], state["num_classes"])
        self.model.load_state_dict(state["model"])
        self.model.eval()
        self.min_len = min_input_len(self.model_cfg)

    def _encode(self, texts: list[str]) -> torch.Tensor:
        unk = self.stoi[UNK]
        rows = []
        for text in texts:
            tokens = self.segmenter.tokenize(self.normalize(text))
            rows.append([self.stoi.get(t, unk) for t in tokens][: self.pre.max_len])
        width = max([self.min_len] + [len(r) for r in rows])
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for i, ids in enumerate(rows):
            batch[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
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
