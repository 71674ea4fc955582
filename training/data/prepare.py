"""The preprocessing stage: raw dataset -> prepared folder.

read -> normalise -> drop empties -> dedupe (conflicting labels dropped) ->
stratified split -> segment -> vocabulary (train only) -> flat int32 arrays.

The folder holds, per split: ``{split}.ids.npy`` (int32 token ids, all texts
end to end), ``{split}.offsets.npy`` (int64, n+1), ``{split}.labels.npy``
(int64) and ``{split}.jsonl`` (the texts as read and as cleaned, and the
label); plus ``vocab.json`` and ``manifest.json``.

    python -c "from training.config import tiny; from training.data.prepare import prepare_dataset; \
               c = tiny(); print(prepare_dataset(c.data, c.preprocess, '/tmp/prepared'))"
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np

import training
from training.config import DataConfig, PreprocessConfig
from training.data.readers import DatasetError, read_dataset
from training.data.vocab import PAD, UNK, build_vocab, encode
from training.text.clean import normalize
from training.text.segment import segment_texts

SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"


def _key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def dedupe(texts: list[str], labels: list[str]) -> tuple[list[int], dict[str, int]]:
    """Indices of the rows to keep: the first of each text; texts seen with two labels are dropped entirely."""
    seen_labels: dict[str, set[str]] = {}
    first: dict[str, int] = {}
    for i, (text, label) in enumerate(zip(texts, labels)):
        seen_labels.setdefault(text, set()).add(label)
        first.setdefault(text, i)
    conflicting = {t for t, ls in seen_labels.items() if len(ls) > 1}
    keep = sorted(i for t, i in first.items() if t not in conflicting)
    conflict_rows = sum(1 for t in texts if t in conflicting)
    return keep, {
        "duplicates_dropped": len(texts) - len(first) - (conflict_rows - len(conflicting)),
        "conflicting_texts": len(conflicting),
        "conflict_rows_dropped": conflict_rows,
    }


def _check_classes(counts: Counter, where: str) -> None:
    if len(counts) < 2:
        only = next(iter(counts), None)
        raise DatasetError(f"{where}: only one class ({only!r}) after cleaning and deduplication; need at least two")
    small = {label: n for label, n in counts.items() if n < len(SPLITS)}
    if small:
        raise DatasetError(
            f"{where}: classes too small to appear in train, val and test (need 3 texts each): "
            + ", ".join(f"{label!r} has {n}" for label, n in sorted(small.items()))
        )


def _seeded_order(indices: list[int], texts: list[str], rng: np.random.Generator) -> list[int]:
    # sort by content hash first so the split depends on the data, not on the row order of the file
    by_hash = sorted(indices, key=lambda i: _key(texts[i]))
    return [by_hash[j] for j in rng.permutation(len(by_hash))]


def stratified_split(
    texts: list[str], labels: list[str], val_ratio: float, test_ratio: float, seed: int, max_samples: int | None = None
) -> dict[str, list[int]]:
    """Indices per split; each label is split in the same proportions, at least one text per split."""
    rng = np.random.default_rng(seed)
    by_label: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        by_label.setdefault(label, []).append(i)
    out: dict[str, list[int]] = {s: [] for s in SPLITS}
    for label in sorted(by_label):
        order = _seeded_order(by_label[label], texts, rng)
        if max_samples is not None and max_samples < len(texts):
            order = order[: max(len(SPLITS), round(len(order) * max_samples / len(texts)))]
        n = len(order)
        n_test = max(1, round(n * test_ratio))
        n_val = max(1, round(n * val_ratio))
        if n - n_test - n_val < 1:
            raise DatasetError(f"label {label!r}: {n} texts are too few for the split ratios")
        out["test"] += order[:n_test]
        out["val"] += order[n_test : n_test + n_val]
        out["train"] += order[n_test + n_val :]
    return {s: sorted(idx) for s, idx in out.items()}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def prepare_dataset(data: DataConfig, pre: PreprocessConfig, out_dir: str | os.PathLike, progress: bool = False) -> dict:
    """Run the whole preprocessing stage into ``out_dir`` (written atomically) and return the manifest."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    raw = read_dataset(data.dataset, data.text_column, data.label_column)
    if not raw.texts:
        raise DatasetError(f"{raw.source}: no texts")
    cleaned = [normalize(t, pre.replace_urls) for t in raw.texts]
    non_empty = [i for i, t in enumerate(cleaned) if t]
    texts = [cleaned[i] for i in non_empty]
    labels = [raw.labels[i] for i in non_empty]
    originals = [raw.texts[i] for i in non_empty]
    keep, dedupe_counts = dedupe(texts, labels)
    texts, labels, originals = [texts[i] for i in keep], [labels[i] for i in keep], [originals[i] for i in keep]
    _check_classes(Counter(labels), raw.source)

    split_idx = stratified_split(texts, labels, data.val_ratio, data.test_ratio, data.seed, data.max_samples)
    label_names = sorted(set(labels))
    label_map = {name: i for i, name in enumerate(label_names)}

    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    all_idx = [i for s in SPLITS for i in split_idx[s]]
    tokens_all = segment_texts(
        [texts[i] for i in all_idx], pre.segmenter, pre.stopwords, pre.num_workers, progress=progress
    )
    tokens_of = dict(zip(all_idx, tokens_all))
    vocab = build_vocab((tokens_of[i] for i in split_idx["train"]), pre.min_freq, pre.max_vocab)
    stoi = {tok: i for i, tok in enumerate(vocab)}

    splits_info = {}
    for split in SPLITS:
        idx = split_idx[split]
        ids, offsets = encode([tokens_of[i] for i in idx], stoi)
        split_labels = np.array([label_map[labels[i]] for i in idx], dtype=np.int64)
        files = [tmp / f"{split}.ids.npy", tmp / f"{split}.offsets.npy", tmp / f"{split}.labels.npy", tmp / f"{split}.jsonl"]
        np.save(files[0], ids)
        np.save(files[1], offsets)
        np.save(files[2], split_labels)
        _write_jsonl(files[3], [{"text": originals[i], "clean": texts[i], "label": labels[i]} for i in idx])
        unk = int((ids == stoi[UNK]).sum())
        splits_info[split] = {
            "n": len(idx),
            "per_label": dict(sorted(Counter(labels[i] for i in idx).items())),
            "tokens": int(len(ids)),
            "unk_rate": round(unk / max(1, len(ids)), 4),
            "digest": _file_digest(files),
            # identifies the (text, label) pairs alone, independent of the vocabulary: used to compare models
            "content_digest": _key("\n".join(sorted(f"{labels[i]}\t{texts[i]}" for i in idx))),
        }
    (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")

    import jieba

    manifest = {
        "format_version": 1,
        "dataset": {"name": raw.name, "source": raw.source, "digest": raw.digest},
        "counts": {
            "read": len(raw.texts),
            "empty_dropped": len(raw.texts) - len(non_empty),
            **dedupe_counts,
            "kept": len(texts),
            "used": sum(len(v) for v in split_idx.values()),
        },
        "splits": splits_info,
        "labels": label_names,
        "label_map": label_map,
        "vocab_size": len(vocab),
        "specials": {"pad": PAD, "unk": UNK},
        "config": {"data": data.model_dump(), "preprocess": pre.model_dump()},
        "versions": {
            "zhflow": training.__version__,
            "jieba": jieba.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "seconds": round(time.perf_counter() - started, 2),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, ensure_ascii=False, indent=2), encoding="utf-8")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return manifest


def load_manifest(prepared_dir: str | os.PathLike) -> dict:
    path = Path(prepared_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest; is {prepared_dir} a prepared dataset folder?")
    return json.loads(path.read_text(encoding="utf-8"))
