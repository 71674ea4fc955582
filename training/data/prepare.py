"""The preprocessing stage: raw dataset -> prepared folder.

read -> normalise -> drop empties -> dedupe (conflicting labels dropped) ->
stratified split -> segment -> vocabulary (train only) -> flat int32 arrays.

The folder holds, per split: ``{split}.ids.npy`` (int32 token ids, all texts
end to end), ``{split}.offsets.npy`` (int64, n+1), the same for characters
(``{split}.char_ids.npy``, ``{split}.char_offsets.npy``), ``{split}.labels.npy``
(int64) and ``{split}.jsonl`` (the texts as read and as cleaned, and the
label); plus ``vocab.json``, ``char_vocab.json`` and ``manifest.json``.

    python -c "from training.presets import tiny; from training.data.prepare import prepare_dataset; \
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
from training.config import AugmentConfig, DataConfig, PreprocessConfig
from training.data.readers import DatasetError, RawDataset, read_dataset
from training.data.vocab import PAD, UNK, build_vocab, encode
from training.storage import writing
from training.text.clean import normalizer
from training.text.segment import Segmenter, file_digest

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


def _check_classes(counts: Counter, where: str, splits: int = len(SPLITS), listed: set[str] | None = None) -> None:
    """``listed``: the labels of the file's rows; one with no text left is an error, not a class silently dropped."""
    gone = sorted((listed or set()) - set(counts))
    if gone:
        raise DatasetError(
            f"{where}: no text of class {', '.join(map(repr, gone))} is left after cleaning and deduplication (each "
            f"was empty once cleaned, or the same text as a row of another label, which drops both); every class needs "
            f"at least {splits} distinct texts")
    if len(counts) < 2:
        only = next(iter(counts), None)
        raise DatasetError(f"{where}: only one class ({only!r}) after cleaning and deduplication; need at least two")
    small = {label: n for label, n in counts.items() if n < splits}
    if small:
        raise DatasetError(
            f"{where}: classes too small to appear in every split (need {splits} texts each): "
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
        n_test = max(1, round(n * test_ratio)) if test_ratio > 0 else 0
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


def _read(data: DataConfig, dataset: str) -> RawDataset:
    field = "data.test_dataset" if dataset == data.test_dataset and dataset != data.dataset else "data.dataset"
    try:
        return _read_file(data, dataset)
    except DatasetError as err:
        if "is neither a built-in corpus" in str(err):  # nothing else names the setting: which file it is
            raise DatasetError(f"{field}: {err}") from None
        raise


def _read_file(data: DataConfig, dataset: str) -> RawDataset:
    return read_dataset(dataset, data.text_column, data.label_column, data.text_columns, data.format, data.encoding,
                        data.quoting)


def _clean(raw: RawDataset, pre: PreprocessConfig) -> tuple[list[str], list[str], list[str], int]:
    """Normalised texts, labels and original texts of the non-empty rows, and how many were empty."""
    clean = normalizer(pre)
    cleaned = [clean(t) for t in raw.texts]
    keep = [i for i, t in enumerate(cleaned) if t]
    return [cleaned[i] for i in keep], [raw.labels[i] for i in keep], [raw.texts[i] for i in keep], len(cleaned) - len(keep)


def _unlabelled(path: Path, pre: PreprocessConfig, labelled: set[str], segmenter: Segmenter, progress: bool) -> dict:
    """The texts of an unlabelled file, cleaned like the dataset, without empties, repeats or any text of the labelled
    data (which may be in validation or test); their tokens; what was dropped."""
    from training.data.readers import decode

    if not path.is_file():
        raise DatasetError(f"{path}: no such file (distill.unlabelled)")
    lines = [line for line in decode(path).splitlines() if line.strip()]
    if not lines:
        raise DatasetError(f"{path}: no texts (distill.unlabelled: one text per line)")
    clean = normalizer(pre)
    kept, seen, dropped = [], set(), {"empty": 0, "repeat": 0, "labelled": 0}
    for line in lines:
        c = clean(line)
        reason = "empty" if not c else "labelled" if c in labelled else "repeat" if c in seen else None
        if reason:
            dropped[reason] += 1
            continue
        seen.add(c)
        kept.append((line, c))
    if not kept:
        raise DatasetError(f"{path}: none of its {len(lines)} texts is left after cleaning and removing those of the "
                           f"labelled data ({dropped['labelled']}) and repeats ({dropped['repeat']})")
    return {"texts": [t for t, _ in kept], "clean": [c for _, c in kept],
            "tokens": segmenter.segment([c for _, c in kept], pre.num_workers, progress=progress),
            "counts": {"unlabelled_read": len(lines), "unlabelled_added": len(kept), "unlabelled_empty_dropped": dropped["empty"],
                       "unlabelled_repeats_dropped": dropped["repeat"], "unlabelled_in_labelled_data_dropped": dropped["labelled"]}}


def check_dataset(data: DataConfig, pre: PreprocessConfig | None = None) -> None:
    """The checks a user's file fails most often, in seconds, before any orchestration starts: it exists, decodes,
    has the columns and labels, more than one class (test file included), and, cleaned and deduplicated as
    preprocessing will, enough texts of every class for the splits."""
    for dataset in filter(None, (data.dataset, data.test_dataset)):
        raw = _read(data, dataset)
        if dataset == data.dataset and len(set(raw.labels)) < 2:
            raise DatasetError(f"{raw.source}: only one class ({raw.labels[0]!r}); need at least two")
        if dataset == data.dataset:  # about 20 microseconds a text
            texts, labels, _, _ = _clean(raw, pre or PreprocessConfig())
            keep, _ = dedupe(texts, labels)
            _check_classes(Counter(labels[i] for i in keep), raw.source, splits=2 if data.test_dataset else len(SPLITS),
                           listed=set(raw.labels))


def sort_labels(labels: set[str]) -> list[str]:
    """Integer labels in numeric order (2 before 10), others alphabetically."""
    if all(label.lstrip("-").isdigit() for label in labels):
        return sorted(labels, key=int)
    return sorted(labels)


def _length_percentiles(offsets: np.ndarray) -> dict[str, float]:
    lengths = np.diff(offsets)
    if not len(lengths):
        return {}
    return {f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)} | {"max": int(lengths.max())}


def prepare_dataset(
    data: DataConfig, pre: PreprocessConfig, out_dir: str | os.PathLike, progress: bool = False,
    augment: AugmentConfig | None = None, tokenizer: str | None = None, unlabelled: str | None = None,
    spans: int = 0,
) -> dict:
    """Run the whole preprocessing stage into ``out_dir`` (written atomically) and return the manifest.
    ``tokenizer``: a pretrained model's folder or hub id; its token ids of the cleaned texts are stored too.
    ``unlabelled``: a text file (one text per line) whose texts join the train split with label -1 (a distillation
    transfer set: a teacher labels them); any text also in the labelled data is left out, so none of a validation or
    test text reaches training.
    ``spans``: that many runs of consecutive words of each train text join the train split with label -1 (see
    ``training.text.augment.span_samples``; a distillation transfer set, as ``unlabelled``)."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    augment = augment or AugmentConfig()
    raw = _read(data, data.dataset)
    if not raw.texts:
        raise DatasetError(f"{raw.source}: no texts")
    texts, labels, originals, n_empty = _clean(raw, pre)
    keep, dedupe_counts = dedupe(texts, labels)
    texts, labels, originals = [texts[i] for i in keep], [labels[i] for i in keep], [originals[i] for i in keep]
    counts = {"read": len(raw.texts), "empty_dropped": n_empty, **dedupe_counts}

    if data.test_dataset:
        # a fixed test set: deduplicated on its own, and its texts removed from train/val so nothing leaks
        test_raw = _read(data, data.test_dataset)
        t_texts, t_labels, t_originals, t_empty = _clean(test_raw, pre)
        t_keep, t_counts = dedupe(t_texts, t_labels)
        t_texts, t_labels, t_originals = [t_texts[i] for i in t_keep], [t_labels[i] for i in t_keep], [t_originals[i] for i in t_keep]
        in_test = set(t_texts)
        pool = [i for i, t in enumerate(texts) if t not in in_test]
        counts |= {"test_file_read": len(test_raw.texts), "test_file_empty_dropped": t_empty,
                   "test_file_duplicates_dropped": t_counts["duplicates_dropped"] + t_counts["conflict_rows_dropped"],
                   "removed_as_in_test_file": len(texts) - len(pool)}
        texts, labels, originals = [texts[i] for i in pool], [labels[i] for i in pool], [originals[i] for i in pool]
        unknown = sorted(set(t_labels) - set(labels))
        if unknown:
            emptied = [u for u in unknown if u in set(raw.labels)]
            raise DatasetError(f"{test_raw.source}: labels not in the training data: {', '.join(map(repr, unknown))}"
                               + (f" (every text of {', '.join(map(repr, emptied))} in {raw.source} is also in this "
                                  "test file, and leaves the training data so that nothing leaks)" if emptied else ""))
        _check_classes(Counter(labels), raw.source, splits=2, listed=set(raw.labels))
        inner = stratified_split(texts, labels, data.val_ratio, 0.0, data.seed, data.max_samples)
        n = len(texts)
        texts, labels, originals = texts + t_texts, labels + t_labels, originals + t_originals
        split_idx = {"train": inner["train"], "val": inner["val"], "test": list(range(n, len(texts)))}
    else:
        _check_classes(Counter(labels), raw.source, listed=set(raw.labels))
        split_idx = stratified_split(texts, labels, data.val_ratio, data.test_ratio, data.seed, data.max_samples)
    counts |= {"kept": len(texts), "used": sum(len(v) for v in split_idx.values())}

    label_names = sort_labels(set(labels))
    label_map = {name: i for i, name in enumerate(label_names)}
    segmenter = Segmenter.from_config(pre)
    all_idx = [i for s in SPLITS for i in split_idx[s]]
    tokens_all = segmenter.segment([texts[i] for i in all_idx], pre.num_workers, progress=progress)
    tokens_of = dict(zip(all_idx, tokens_all))
    rows = {s: [{"text": originals[i], "clean": texts[i], "label": labels[i]} for i in split_idx[s]] for s in SPLITS}
    token_lists = {s: [tokens_of[i] for i in split_idx[s]] for s in SPLITS}
    label_lists = {s: [labels[i] for i in split_idx[s]] for s in SPLITS}

    if augment.enabled:  # after the split, on train only: no augmented copy of a test text can exist
        from training.text.augment import augment_texts, load_builtin_synonyms, load_synonyms

        synonyms = load_synonyms(augment.synonyms) if augment.synonyms else load_builtin_synonyms()
        new_tokens, new_labels = augment_texts(
            token_lists["train"], label_lists["train"], augment.n_aug, augment.seed, synonyms,
            p_delete=augment.p_delete, p_swap=augment.p_swap, p_insert=augment.p_insert, p_synonym=augment.p_synonym,
        )
        token_lists["train"] += new_tokens
        label_lists["train"] += new_labels
        rows["train"] += [{"text": None, "clean": " ".join(t), "label": l, "augmented": True} for t, l in zip(new_tokens, new_labels)]
        counts["augmented_added"] = len(new_tokens)

    if spans:  # parts of the train texts only, as the augmented copies: no part of a test text reaches training
        from dataclasses import replace

        from training.text.augment import span_samples

        words = replace(segmenter, stopwords="none", stopwords_file=None).segment(  # every word: the parts read as text
            [r["clean"] for r in rows["train"][:len(split_idx["train"])]], pre.num_workers, progress=progress)
        labelled = set(texts)
        new_texts = [t for t in ("".join(span) for span in span_samples(words, spans, augment.seed)) if t not in labelled]
        token_lists["train"] += segmenter.segment(new_texts, pre.num_workers, progress=progress)
        label_lists["train"] += [None] * len(new_texts)
        rows["train"] += [{"text": t, "clean": t, "label": None, "unlabelled": True} for t in new_texts]
        counts["spans_added"] = len(new_texts)

    if unlabelled:
        extra = _unlabelled(Path(unlabelled), pre, set(texts), segmenter, progress)
        token_lists["train"] += extra["tokens"]
        label_lists["train"] += [None] * len(extra["tokens"])
        rows["train"] += [{"text": t, "clean": c, "label": None, "unlabelled": True} for t, c in zip(extra["texts"], extra["clean"])]
        counts |= extra["counts"]

    vocab = build_vocab(token_lists["train"], pre.min_freq, pre.max_vocab)
    stoi = {tok: i for i, tok in enumerate(vocab)}
    # characters too (placeholders whole), so character-input models need no second pass over the data
    chars = Segmenter("char", "none")
    char_lists = {s: [chars.tokenize(r["clean"]) for r in rows[s]] for s in SPLITS}
    char_vocab = build_vocab(char_lists["train"], pre.min_freq, pre.max_vocab)
    char_stoi = {ch: i for i, ch in enumerate(char_vocab)}
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # a full disk or read-only folder: a clear error, the partial folder removed, earlier results untouched
        with writing("the prepared dataset", out_dir):
            tmp.mkdir(parents=True)
            splits_info = {}
            for split in SPLITS:
                ids, offsets = encode(token_lists[split], stoi)
                split_labels = np.array([-1 if l is None else label_map[l] for l in label_lists[split]], dtype=np.int64)
                files = [tmp / f"{split}.ids.npy", tmp / f"{split}.offsets.npy", tmp / f"{split}.labels.npy", tmp / f"{split}.jsonl"]
                np.save(files[0], ids)
                np.save(files[1], offsets)
                np.save(files[2], split_labels)
                _write_jsonl(files[3], rows[split])
                char_ids, char_offsets = encode(char_lists[split], char_stoi)
                np.save(tmp / f"{split}.char_ids.npy", char_ids)
                np.save(tmp / f"{split}.char_offsets.npy", char_offsets)
                unk = int((ids == stoi[UNK]).sum())
                originals_only = [r for r in rows[split] if not r.get("augmented") and not r.get("unlabelled")]
                splits_info[split] = {
                    "n": len(split_labels),
                    "per_label": dict(sorted(Counter(l for l in label_lists[split] if l is not None).items())),
                    "tokens": int(len(ids)),
                    "unk_rate": round(unk / max(1, len(ids)), 4),
                    "token_length": _length_percentiles(offsets),
                    "digest": _file_digest(files),
                    # identifies the (text, label) pairs alone, independent of the vocabulary: used to compare models
                    "content_digest": _key("\n".join(sorted(f"{r['label']}\t{r['clean']}" for r in originals_only))),
                }
            tokenized = None
            if tokenizer:  # the pretrained family's own ids, of the same cleaned (and augmented) texts
                from training.models.pretrained import tokenize_splits

                tokenized = tokenize_splits(tokenizer, {split: [r["clean"] for r in rows[split]] for split in SPLITS},
                                            pre.max_len, tmp)
            (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")

            (tmp / "char_vocab.json").write_text(json.dumps(char_vocab, ensure_ascii=False), encoding="utf-8")

            import jieba

            manifest = {
                "format_version": 1,
                "dataset": {"name": raw.name, "source": raw.source, "digest": raw.digest},
                "test_dataset": {"source": data.test_dataset, "digest": file_digest(data.test_dataset)} if data.test_dataset else None,
                "counts": counts,
                "splits": splits_info,
                "labels": label_names,
                "label_map": label_map,
                "vocab_size": len(vocab),
                "char_vocab_size": len(char_vocab),
                "specials": {"pad": PAD, "unk": UNK},
                "tokenizer": tokenized,
                "config": {"data": data.model_dump(), "preprocess": pre.model_dump(), "augment": augment.model_dump(), "spans": spans},
                "files": {"user_dict": file_digest(pre.user_dict), "stopwords_file": file_digest(pre.stopwords_file),
                          "synonyms": file_digest(augment.synonyms) if augment.enabled else None,
                          "unlabelled": file_digest(unlabelled) if unlabelled else None},
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def manifest_markdown(manifest: dict) -> str:
    c = manifest["counts"]
    lines = [
        f"# Prepared dataset `{Path(manifest['dataset']['name']).name}`",
        "",
        f"digest `{manifest['dataset']['digest'][:16]}`, vocabulary {manifest['vocab_size']}, labels {', '.join(manifest['labels'])}",
        "",
        "| count | value |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in c.items()],
        "",
        "| split | texts | per label | OOV rate | tokens p50 / p90 / max |", "|---|---|---|---|---|",
    ]
    for split, info in manifest["splits"].items():
        tl = info.get("token_length", {})
        per_label = ", ".join(f"{k}: {v}" for k, v in info["per_label"].items())
        lines.append(f"| {split} | {info['n']} | {per_label} | {info['unk_rate']:.2%} | "
                     f"{tl.get('p50', 0):.0f} / {tl.get('p90', 0):.0f} / {tl.get('max', 0)} |")
    return "\n".join(lines)


def load_manifest(prepared_dir: str | os.PathLike) -> dict:
    path = Path(prepared_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest; is {prepared_dir} a prepared dataset folder?")
    return json.loads(path.read_text(encoding="utf-8"))
