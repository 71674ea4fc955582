"""Bad input, one row each: what a user can hand zhflow, and what they get back.

Every row goes through the project's own code (readers, prepare_dataset, normalize, Segmenter, apply_overrides,
the zhflow command) and expects either an error of a given type whose message names the file and line or the
setting, or a result given exactly. A row's id says which, and what the result is.
"""

import contextlib
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import sentiment_rows, write_csv
from training.config import ConfigError, DataConfig, PreprocessConfig, check_experiment
from training.overrides import apply_overrides
from training.presets import tiny
from training.data.prepare import prepare_dataset
from training.data.readers import DatasetError, read_dataset
from training.text.clean import normalize
from training.text.segment import MAX_TEXT_CHARS, Segmenter


@dataclass
class Error:
    """The call raises ``kind`` and its message holds every fragment (file and line, or the setting)."""

    kind: type
    fragments: tuple[str, ...]


@dataclass
class Exit:
    """``zhflow ...`` exits with ``code`` and says every fragment on stderr, without a traceback."""

    code: int
    fragments: tuple[str, ...]


def error(kind: type, *fragments: str) -> Error:
    return Error(kind, fragments)


def exits(code: int, *fragments: str) -> Exit:
    return Exit(code, fragments)


def file(name: str, content: bytes, encoding: str | None = None):
    """``content`` saved as ``name`` and read with read_dataset: (texts, labels)."""
    def run(tmp: Path):
        path = tmp / name
        path.write_bytes(content)
        raw = read_dataset(str(path), encoding=encoding)
        return raw.texts, raw.labels
    return run


def prepared(rows: list[tuple[str, str]], name: str = "reviews.csv"):
    """prepare_dataset on a CSV of ``rows``; the manifest's counts."""
    def run(tmp: Path):
        path = write_csv(tmp / name, rows)
        return prepare_dataset(DataConfig(dataset=str(path)), PreprocessConfig(min_freq=1), tmp / "out")["counts"]
    return run


def _launch_nproc(requested: int) -> int:
    from tasks.launch import resolve_nproc  # where a job's process count meets the machine (no GPU here: CPU cores)

    return resolve_nproc(requested)


def override(*items: str):
    return lambda tmp: apply_overrides(tiny(), list(items))


def cli(*args: str, dataset: bool = False):
    """``zhflow args`` through flows.cli.main, in the test's folder: (exit code, stderr)."""
    def run(tmp: Path):
        from flows.cli import main

        argv = list(args) + (["--dataset", str(write_csv(tmp / "reviews.csv", sentiment_rows(10)))] if dataset else [])
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse and parser.exit
                code = exit_.code
        return code, err.getvalue()
    return run


PHRASE, REPEATS = "这本书非常好看值得一读质量很好", 233_334  # 3.5 million characters, 10.5 MB in UTF-8


def ten_mb_line(tmp: Path):
    """A 10 MB review without punctuation among ordinary ones: prepared in seconds, segmented up to MAX_TEXT_CHARS."""
    rows = sentiment_rows(10) + [(PHRASE * REPEATS, "positive")]
    started = time.perf_counter()
    path = write_csv(tmp / "long.csv", rows)
    manifest = prepare_dataset(DataConfig(dataset=str(path)), PreprocessConfig(min_freq=1), tmp / "out")
    assert time.perf_counter() - started < 60  # about 2 s on a 2-core machine; quadratic would be hours
    lengths = [int(n) for s in ("train", "val", "test") for n in np.diff(np.load(tmp / "out" / f"{s}.char_offsets.npy"))]
    stored = [json.loads(line)["clean"] for s in ("train", "val", "test")
              for line in (tmp / "out" / f"{s}.jsonl").read_text(encoding="utf-8").splitlines()]
    return manifest["counts"]["kept"], max(lengths), max(map(len, stored))


def ten_mb_word(tmp: Path):
    """10 MB of ASCII letters without a space: the e-mail pattern used to try every start position (quadratic)."""
    started = time.perf_counter()
    address = normalize("a" * 10_000_000 + "@qq.com")
    no_address = normalize("a" * 10_000_000 + "@")
    assert time.perf_counter() - started < 30  # about 2 s
    return address, len(Segmenter("char", "none").tokenize(no_address))


CASES = [
    # ---- text: normalize and Segmenter ---------------------------------------------------------------------
    pytest.param(lambda tmp: normalize(""), "", id="normalize: empty string -> ''"),
    pytest.param(lambda tmp: normalize(" \t\u3000\r\n  "), "", id="normalize: whitespace only -> ''"),
    pytest.param(lambda tmp: Segmenter("jieba").tokenize(normalize(" \t\n")), [], id="segment: whitespace only -> no tokens"),
    pytest.param(lambda tmp: normalize("好\u200b看\x00\x07了\u2060\ufeff"), "好看了",
                 id="normalize: zero-width and control chars dropped"),
    # \f and \x85 are control characters but whitespace: they used to vanish and glue the words together
    pytest.param(lambda tmp: normalize("hello\x0cworld\x85ok"), "hello world ok",
                 id="normalize: form feed and NEL separate words"),
    # a dropped character between a letter and its accent: NFKC used to run first and leave e + U+0301 behind,
    # which a second normalize turned into é (not idempotent)
    pytest.param(lambda tmp: normalize("e\u200b\u0301"), "\u00e9",
                 id="normalize: zero-width between letter and accent -> precomposed"),
    pytest.param(lambda tmp: normalize("好\ud800看\udfff"), "好看", id="normalize: lone surrogates dropped"),
    # rjieba (Rust) used to raise UnicodeEncodeError on a lone surrogate
    pytest.param(lambda tmp: [Segmenter(b, "none").tokenize("好看\ud800") for b in ("jieba", "rjieba", "char")],
                 [["好看"], ["好看"], ["好", "看"]], id="segment: lone surrogate dropped by every backend"),
    # the zero-width joiner goes like any zero-width character: the family becomes its three people
    pytest.param(lambda tmp: normalize("👨\u200d👩\u200d👧"), "👨👩👧", id="emoji keep: ZWJ family -> its people"),
    pytest.param(lambda tmp: normalize("好👨\u200d👩\u200d👧看", emoji="remove"), "好 看", id="emoji remove: ZWJ family -> space"),
    pytest.param(lambda tmp: (normalize("好🇨🇳"), normalize("好🇨🇳", emoji="remove")), ("好🇨🇳", "好"), id="emoji: flag kept / removed"),
    pytest.param(lambda tmp: normalize("赞👍🏽", emoji="remove"), "赞", id="emoji remove: skin tone goes with the hand"),
    # the keycap used to leave '1 \u20e3' behind
    pytest.param(lambda tmp: normalize("1\ufe0f\u20e3号", emoji="remove"), "号", id="emoji remove: keycap 1️⃣ goes whole"),
    pytest.param(lambda tmp: Segmenter("jieba", "none").tokenize(normalize("好看👍🏽🇨🇳")),
                 ["好看", "👍", "🏽", "🇨", "🇳"], id="segment: emoji -> one token per code point"),
    pytest.param(lambda tmp: Segmenter("jieba").tokenize(normalize("Hello世界１２３Привет")),
                 ["hello", "世界", "123", "п", "р", "и", "в", "е", "т"], id="mixed scripts: lower-cased, Cyrillic per letter"),
    # the e-mail pattern took Chinese letters as part of the address and swallowed the whole sentence
    pytest.param(lambda tmp: normalize("联系我abc@qq.com谢谢"), "联系我 <email> 谢谢", id="mixed scripts: Chinese around an e-mail stays"),
    pytest.param(ten_mb_line, (21, MAX_TEXT_CHARS, len(PHRASE) * REPEATS),
                 id="10 MB line without punctuation: stored whole, segmented to 100k chars"),
    pytest.param(ten_mb_word, ("<email>", MAX_TEXT_CHARS),
                 id="10 MB ASCII word: one <email>, or without a domain segmented to 100k chars"),
    # ---- files: read_dataset and prepare_dataset ---------------------------------------------------------
    pytest.param(file("bad.csv", "text,label\n好看,pos\n".encode() + b"\xff\xfe,neg\n"),
                 error(DatasetError, "bad.csv: line 3: bytes that are not valid UTF-8"),
                 id="invalid UTF-8 bytes -> file and line"),
    pytest.param(file("gbk.csv", "text,label\n这本书好看,正面\n质量很差,负面\n".encode("gbk")),
                 (["这本书好看", "质量很差"], ["正面", "负面"]), id="GBK file, auto-detect -> read as GB18030"),
    pytest.param(file("gbk.csv", "text,label\n好看,正面\n".encode("gbk"), encoding="utf-8"),
                 error(DatasetError, "gbk.csv: line 2: bytes that are not valid utf-8", "--encoding"),
                 id="GBK file read as UTF-8 -> file and line"),
    pytest.param(file("bom.csv", "\ufefftext,label\n好看,pos\n".encode()), (["好看"], ["pos"]),
                 id="UTF-8 BOM -> stripped, header found"),
    pytest.param(file("crlf.csv", "text,label\r\n好看,pos\r\n很差,neg\r\n".encode()), (["好看", "很差"], ["pos", "neg"]),
                 id="CRLF line endings -> no stray \\r"),
    pytest.param(file("crlf.tsv", "text\tlabel\r\n好看\tpos\r\n很差\tneg\r\n".encode()), (["好看", "很差"], ["pos", "neg"]),
                 id="CRLF TSV -> no stray \\r"),
    pytest.param(file("ws.csv", "text,label\n好看,pos\n   ,neg\n\n  \t \n很差,neg\n".encode()), (["好看", "", "很差"], ["pos", "neg", "neg"]),
                 id="blank and whitespace-only lines skipped; a blank text is read as '' (cleaning drops it)"),
    # pandas skipped the blank lines but the line numbers assumed one record per line: this said line 3
    pytest.param(file("gaps.csv", "text,label\n\n好看,pos\n   \n很差,\n".encode()), error(DatasetError, "gaps.csv: line 5: empty label"),
                 id="error after blank lines -> the right line"),
    pytest.param(file("quoted.csv", 'text,label\n"好\n看",pos\n很差,\n'.encode()), error(DatasetError, "quoted.csv: line 4: empty label"),
                 id="error after a quoted line break -> the right line"),
    # pandas took the first column as the index and shifted every value one column left, silently
    pytest.param(file("extra.csv", "text,label\n好看,pos,3\n很差,neg\n".encode()),
                 error(DatasetError, "extra.csv: line 2: 3 fields, but the header has 2"),
                 id="a row with an extra field -> file and line"),
    pytest.param(file("open.csv", 'text,label\n好看,pos\n"很差,neg\n还行,pos\n'.encode()),
                 error(DatasetError, "open.csv: line 3: a quote opened here is never closed"),
                 id="unclosed quote -> file and line"),
    pytest.param(file("sp.csv", 'text,label\n好看, positive\n很差,negative\t\n还行," positive "\n'.encode()),
                 (["好看", "很差", "还行"], ["positive", "negative", "positive"]), id="labels with stray spaces -> stripped"),
    pytest.param(file("sph.csv", " text , label \n好看,pos\n".encode()), (["好看"], ["pos"]),
                 id="header names with stray spaces -> stripped"),
    # a float column written to CSV ('1.0') now gives the classes the same file gives as JSON or Parquet ('1')
    pytest.param(file("float.csv", "text,label\n好看,1.0\n很差,0.0\n还行,1\n".encode()), (["好看", "很差", "还行"], ["1", "0", "1"]),
                 id="float labels in CSV -> 1.0 and 1 one class '1'"),
    pytest.param(file("float.jsonl", b'{"text": "a", "label": 1.0}\n{"text": "b", "label": 0.5}\n{"text": "c", "label": 1}\n'),
                 (["a", "b", "c"], ["1", "0.5", "1"]), id="float labels in JSONL -> '1', '0.5' kept as written"),
    # a null in the column made pandas turn the column into floats: the text 123 became '123.0'
    pytest.param(file("num.jsonl", b'{"text": 123, "label": "a"}\n{"text": null, "label": "b"}\n'), (["123", ""], ["a", "b"]),
                 id="JSON number as text next to a null -> '123'"),
    # a \ud800 escape is valid JSON but no text: it crashed later with UnicodeEncodeError naming no file
    pytest.param(file("sur.jsonl", b'{"text": "ok", "label": "a"}\n{"text": "bad \\ud800", "label": "b"}\n'),
                 error(DatasetError, "sur.jsonl: line 2: field 'text' holds a lone surrogate"),
                 id="JSON lone surrogate escape -> file and line"),
    pytest.param(prepared([(f"好看{i}", "positive") for i in range(10)], "one.csv"),
                 error(DatasetError, "one.csv: only one class ('positive')"), id="one-class dataset -> names the file and class"),
    pytest.param(prepared(sentiment_rows(10) + [("", "positive"), ("   ", "negative"), ("\u200b\x00", "positive")]),
                 {"read": 23, "empty_dropped": 3, "duplicates_dropped": 0, "conflicting_texts": 0,
                  "conflict_rows_dropped": 0, "kept": 20, "used": 20},
                 id="empty, whitespace-only and control-only texts -> dropped and counted"),
    pytest.param(file("empty.csv", b""), error(DatasetError, "empty.csv: the file is empty"), id="empty file"),
    pytest.param(file("header.csv", b"text,label\r\n"), error(DatasetError, "header.csv: no data rows (header only)"),
                 id="header-only file"),
    pytest.param(file("blank.jsonl", b"\n  \n\t\n"), error(DatasetError, "blank.jsonl: no data rows (blank lines only)"),
                 id="JSONL of blank lines"),
    pytest.param(file("notext.csv", "review,label\n好看,pos\n".encode()),
                 error(DatasetError, "notext.csv: no column 'text'; columns are review, label"), id="missing text column"),
    pytest.param(file("nolabel.jsonl", '{"text": "好看", "y": "pos"}\n'.encode()),
                 error(DatasetError, "nolabel.jsonl: no column 'label'; columns are text, y"), id="missing label column"),
    # ---- settings: apply_overrides, check_experiment and the zhflow command ----------------------------------
    pytest.param(cli("run", "--preset", "tiny", "--nproc", "0"), exits(2, "train.nproc", "greater than or equal to 1"),
                 id="zhflow run --nproc 0"),
    pytest.param(cli("run", "--preset", "tiny", "--nproc", "5000"), exits(2, "train.nproc", "less than or equal to 1024"),
                 id="zhflow run --nproc 5000"),
    # the machine is known only at launch: there nproc is checked against its GPUs or CPU cores
    pytest.param(lambda tmp: override("train.nproc=64")(tmp).train.nproc, 64, id="train.nproc=64 above the cores -> accepted"),
    pytest.param(lambda tmp: _launch_nproc(os.cpu_count() + 1), error(ValueError, "train.nproc", "CPU core"),
                 id="train.nproc above the cores -> refused at launch"),
    pytest.param(override("train.batch_size=0"), error(ConfigError, "train.batch_size", "greater than or equal to 1"),
                 id="batch size 0"),
    pytest.param(override("train.lr=NaN"), error(ConfigError, "train.lr", "finite number"), id="learning rate NaN"),
    pytest.param(override("train.lr=inf"), error(ConfigError, "train.lr", "finite number"), id="learning rate inf"),
    pytest.param(override("train.lr=-1e-3"), error(ConfigError, "train.lr", "greater than 0"), id="learning rate negative"),
    pytest.param(override("prune.finetune_lr=Infinity"), error(ConfigError, "prune.finetune_lr", "finite number"),
                 id="fine-tune learning rate inf"),
    pytest.param(override("train.epochs=0"), error(ConfigError, "train.epochs", "greater than or equal to 1"), id="epochs 0"),
    pytest.param(override("prune.amount=-0.1"), error(ConfigError, "prune.amount", "greater than or equal to 0"),
                 id="pruning amount below 0"),
    pytest.param(override("prune.amount=1.5"), error(ConfigError, "prune.amount", "less than 1"), id="pruning amount above 1"),
    pytest.param(override("prune.amount=1"), error(ConfigError, "prune.amount", "less than 1"),
                 id="pruning amount exactly 1 (no weights left)"),
    pytest.param(cli("run", "--preset", "tiny", "--set", "train.batch_size=0"), exits(2, "train.batch_size"),
                 id="zhflow run --set train.batch_size=0"),
    pytest.param(cli("sweep", "--preset", "tiny", "--trials", "0", dataset=True), exits(2, "--trials", "at least 1", "got 0"),
                 id="zhflow sweep --trials 0"),
    # MLflow takes '/' in experiment names (team/project), and zhflow never makes a path of one
    pytest.param(lambda tmp: check_experiment("team/zhflow"), "team/zhflow", id="experiment name with / -> accepted"),
    # the flows refused it only after the Prefect server had started: exit 1, 'the pipeline failed: ParameterTypeError'
    pytest.param(cli("run", "--preset", "tiny", "--experiment", "x" * 500),
                 exits(2, "--experiment", "at most 200 characters", "(500 characters)"),
                 id="zhflow run --experiment of 500 chars -> exit 2 before any work"),
    pytest.param(cli("evaluate", "--model-uri", "models:/m@champion", "--dataset", "d.csv", "--experiment", ""),
                 exits(2, "--experiment", "at least 1 character"), id="zhflow evaluate --experiment '' -> exit 2"),
]


@pytest.mark.parametrize("run, expected", CASES)
def test_bad_input(run, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing the command might write lands in the checkout
    monkeypatch.delenv("ZHFLOW_OWNER", raising=False)  # the command sets it for its children
    if isinstance(expected, Error):
        with pytest.raises(expected.kind) as info:
            run(tmp_path)
        for fragment in expected.fragments:
            assert fragment in str(info.value)
    elif isinstance(expected, Exit):
        code, stderr = run(tmp_path)
        assert code == expected.code, stderr
        for fragment in expected.fragments:
            assert fragment in stderr
        assert "Traceback" not in stderr
        assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / ".zhflow").exists()  # nothing started
    else:
        assert run(tmp_path) == expected


def test_the_table_covers_enough_cases():
    assert len({p.id for p in CASES}) == len(CASES) >= 27
