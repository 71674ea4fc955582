"""The pretraining corpus: unlabelled text read, cleaned, deduplicated and tokenized as a stream, in shards on disk.

    prepare_corpus(config, out_dir)      # -> manifest; resumes at the last shard written
    CorpusShards(out_dir, "train")       # the worker's view: memory-mapped, a rank reads only its rows

Three passes, none of which holds the corpus in memory:

1. **Read and clean** (this process): each file as a stream of texts (a ``.txt`` file line by line; a table's text
   column(s); a prepared folder's train split), normalised as ``zhflow run`` does, empty texts dropped, exact
   duplicates dropped by a 64-bit hash (a sorted array of the hashes seen: 8 bytes a text), texts of the validation
   and test splits of ``corpus.exclude_prepared`` removed, a seeded share held out. The cleaned texts go to
   ``text/NNNNN.txt``, one shard every ``corpus.shard_texts`` texts; after each shard the reading position, counts
   and hashes are saved, so an interrupted preparation goes on from there.
2. **Tokenizer**: the one of ``model.init_from``, or a WordPiece tokenizer trained on the cleaned shards with the
   ``tokenizers`` library (Chinese characters as single tokens), saved in ``tokenizer/``.
3. **Tokenize and segment** (processes in parallel, one shard each): token ids cut into sequences of at most
   ``model.max_len``, and for each token whether it starts a jieba word (whole-word masking) or is a special token,
   as flat arrays ``NNNNN.ids.npy``, ``.offsets.npy``, ``.words.npy``. A shard whose arrays exist is not redone.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from training.config import CorpusConfig, EncoderConfig, PreprocessConfig
from training.data.readers import BUILTIN, DatasetError, FORMATS, dataset_files, decode
from training.text.clean import normalizer

MANIFEST = "manifest.json"
STATE = "state.json"
TOKENIZER_DIR = "tokenizer"
HELD_OUT = "heldout"
SPECIAL, WORD_START, WORD_INSIDE = 2, 1, 0  # the words array: what each token is
SIZES = {  # a new encoder's shape (BertConfig fields) and tokenizer size
    "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 256, "vocab_size": 4000},
    "small": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024, "vocab_size": 16000},
    "base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 21128},
}
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


class CorpusError(DatasetError):
    """A corpus that cannot be pretrained on; the message names the file."""


def text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _held_out(text: str, seed: int, share: float) -> bool:
    """A seeded, stable choice: the same text is held out in every preparation with the same seed."""
    h = hashlib.blake2b(text.encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(h, "little") / 2**64 < share


class HashSet:
    """The hashes of the texts kept so far: a sorted uint64 array (8 bytes a text, merged once a shard)."""

    def __init__(self, values: np.ndarray | None = None):
        self.sorted = np.unique(values.astype(np.uint64)) if values is not None else np.zeros(0, dtype=np.uint64)
        self.pending: set[int] = set()

    def add(self, value: int) -> bool:
        """True if it was new."""
        if value in self.pending:
            return False
        if len(self.sorted):
            at = np.searchsorted(self.sorted, np.uint64(value))
            if at < len(self.sorted) and self.sorted[at] == value:
                return False
        self.pending.add(value)
        return True

    def merge(self) -> None:
        if self.pending:
            self.sorted = np.union1d(self.sorted, np.fromiter(self.pending, dtype=np.uint64, count=len(self.pending)))
            self.pending = set()

    def __contains__(self, value: int) -> bool:
        return value in self.pending or (len(self.sorted) > 0 and self.sorted[min(np.searchsorted(self.sorted, np.uint64(value)), len(self.sorted) - 1)] == value)


# ---- pass 1: read and clean -------------------------------------------------------------------------------------
def _text_lines(path: Path, encoding: str | None, start: int) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file from line ``start`` (1-based), read as a stream. An encoding error names
    the line; a file that is not UTF-8 at all is read as GB18030 (as zhflow run does)."""
    chosen = encoding or "utf-8-sig"
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if encoding is None:
        try:
            head.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            if err.start < len(head) - 4:  # not a character cut at the end of the sample
                try:
                    decode(path)  # the whole file: UTF-8 with bad bytes, or GB18030 (raises naming the line)
                    chosen = "gb18030"
                except DatasetError as bad:
                    raise CorpusError(str(bad)) from None
        if b"\0" in head:
            raise CorpusError(f"{path}: not a text file (it holds NUL bytes); a corpus file has one text per line")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number < start:
                continue
            try:
                line = raw.decode(chosen)
            except UnicodeDecodeError as err:
                raise CorpusError(f"{path}: line {number}: bytes that are not valid {chosen} ({err.reason}); "
                                  "pass the file's encoding with --encoding") from None
            yield number, line[1:] if number == 1 and line.startswith("\ufeff") else line


def _table_texts(path: Path, corpus: CorpusConfig, start: int) -> Iterator[tuple[int, str]]:
    """A table file's text column(s); a table is read whole (labelled datasets are modest), then given row by row."""
    from training.data.readers import _frame, _is_missing

    frame, lines = _frame(path, FORMATS[path.suffix.lower()], corpus.encoding)
    for column in corpus.text_columns:
        if column not in frame.columns:
            raise CorpusError(f"{path}: no column {column!r} (corpus.text_columns); columns are "
                              f"{', '.join(map(str, frame.columns)) or 'none'}")
    parts = [["" if _is_missing(v) else str(v) for v in frame[c]] for c in corpus.text_columns]
    for number, row in enumerate(zip(*parts), 1):
        if number >= start:
            yield number, " ".join(p for p in row if p)


def _prepared_texts(folder: Path, split: str, start: int) -> Iterator[tuple[int, str]]:
    path = folder / f"{split}.jsonl"
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if number >= start and line.strip():
                yield number, json.loads(line)["clean"]


def corpus_sources(corpus: CorpusConfig) -> list[Path]:
    """The corpus files, checked: each exists and is a kind zhflow reads."""
    if not corpus.files:
        raise CorpusError("corpus.files: no corpus given (--corpus FILE: text files with one text per line, a dataset, "
                          "or a prepared folder)")
    paths = []
    for name in corpus.files:
        if name == BUILTIN:  # the built-in corpus's texts, without their labels
            paths += dataset_files(BUILTIN)
            continue
        path = Path(name).expanduser()
        if path.is_dir():
            if not (path / "train.jsonl").is_file():
                raise CorpusError(f"{path}: a folder, but not a prepared dataset (no train.jsonl)")
        elif not path.is_file():
            raise CorpusError(f"{path}: no such corpus file")
        elif path.suffix.lower() not in (".txt", ".text", "") and path.suffix.lower() not in FORMATS:
            raise CorpusError(f"{path}: unknown extension {path.suffix!r}; a corpus is .txt (one text per line) or "
                              f"one of {', '.join(FORMATS)}")
        elif path.stat().st_size == 0:
            raise CorpusError(f"{path}: the file is empty")
        paths.append(path)
    for name in corpus.exclude_prepared:
        folder = Path(name).expanduser()
        if not all((folder / f"{s}.jsonl").is_file() for s in ("val", "test")):
            raise CorpusError(f"corpus.exclude_prepared: {folder}: not a prepared dataset folder (no val.jsonl / test.jsonl)")
    return paths


def check_corpus(corpus: CorpusConfig) -> None:
    """The files exist, are text, and at least one of them holds a text that cleaning leaves (the scan stops at the
    first): checked before any run is recorded."""
    clean = normalizer(PreprocessConfig())
    paths = corpus_sources(corpus)
    for path in paths:
        if any(clean(text) for _, text in _texts(path, corpus, 1)):
            return
    raise CorpusError(f"{', '.join(map(str, paths))}: no text left to pretrain on after cleaning (every line is empty "
                      "or only whitespace, control or zero-width characters)")


def _texts(path: Path, corpus: CorpusConfig, start: int) -> Iterator[tuple[int, str]]:
    if path.is_dir():
        return _prepared_texts(path, "train", start)
    if path.suffix.lower() in FORMATS:
        return _table_texts(path, corpus, start)
    return _text_lines(path, corpus.encoding, start)


def excluded_hashes(corpus: CorpusConfig, clean: Callable[[str], str]) -> set[int]:
    """The hashes of the validation and test texts of the prepared datasets named (cleaned as the corpus is)."""
    out: set[int] = set()
    for name in corpus.exclude_prepared:
        for split in ("val", "test"):
            for _, text in _prepared_texts(Path(name).expanduser(), split, 1):
                if cleaned := clean(text):
                    out.add(text_hash(cleaned))
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def read_and_clean(corpus: CorpusConfig, out: Path, progress: Callable[[str], None] = print) -> dict:
    """Pass 1 (see the module's doc); returns the counts. Goes on from ``state.json`` if an earlier attempt stopped."""
    clean = normalizer(PreprocessConfig())
    paths = corpus_sources(corpus)
    text_dir = out / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    state_file = out / STATE
    if state_file.is_file():
        state = json.loads(state_file.read_text())
        seen = HashSet(np.load(out / "seen.npy"))
        progress(f"corpus: going on after shard {state['shards']} ({state['counts']['kept']} texts so far)")
    else:
        state = {"file": 0, "line": 1, "shards": 0, "held_out": 0, "done": False,
                 "counts": {"read": 0, "empty": 0, "duplicates": 0, "excluded": 0, "held_out": 0, "kept": 0}}
        seen = HashSet()
    if state["done"]:
        return state["counts"]
    exclude = excluded_hashes(corpus, clean)
    counts, buffer, held = state["counts"], [], []
    held_file = out / f"{HELD_OUT}.txt"
    if state["file"] == 0 and state["line"] == 1:
        held_file.write_text("")
    started, last_report = time.perf_counter(), 0.0

    def flush(next_file: int, next_line: int, done: bool = False) -> None:
        nonlocal buffer, held
        if buffer:
            (text_dir / f"{state['shards']:05d}.txt").write_text("\n".join(buffer) + "\n", encoding="utf-8")
            state["shards"] += 1
        if held:
            with open(held_file, "a", encoding="utf-8") as f:
                f.write("\n".join(held) + "\n")
        seen.merge()
        _save_npy(out / "seen.npy", seen.sorted)
        state.update(file=next_file, line=next_line, done=done)
        _write_atomic(state_file, json.dumps(state).encode())
        buffer, held = [], []

    for index in range(state["file"], len(paths)):
        start = state["line"] if index == state["file"] else 1
        number = start - 1
        for number, raw in _texts(paths[index], corpus, start):
            counts["read"] += 1
            text = clean(raw)
            if not text:
                counts["empty"] += 1
                continue
            h = text_hash(text)
            if h in exclude:
                counts["excluded"] += 1
                continue
            if not seen.add(h):
                counts["duplicates"] += 1
                continue
            if counts["held_out"] < corpus.held_out_max and _held_out(text, corpus.seed, corpus.held_out):
                counts["held_out"] += 1
                held.append(text)
                continue
            counts["kept"] += 1
            buffer.append(text)
            if len(buffer) >= corpus.shard_texts:
                flush(index, number + 1)
            if time.perf_counter() - last_report > 10:
                last_report = time.perf_counter()
                progress(f"corpus: {counts['read']} texts read, {counts['kept']} kept "
                         f"({counts['read'] / max(1e-9, last_report - started):.0f} texts/s)")
        flush(index + 1, 1)
    if counts["kept"] == 0:
        names = ", ".join(str(p) for p in paths)
        raise CorpusError(f"{names}: no text left to pretrain on after cleaning ({counts['read']} read, {counts['empty']} "
                          f"empty, {counts['duplicates']} duplicates, {counts['excluded']} excluded, {counts['held_out']} held out)")
    flush(len(paths), 1, done=True)
    return counts


def cleaned_shards(out: Path) -> list[Path]:
    return sorted((out / "text").glob("[0-9]*.txt"))


def _cleaned_lines(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line := line.rstrip("\n"):
                    yield line


# ---- pass 2: tokenizer ------------------------------------------------------------------------------------------
def train_tokenizer(out: Path, vocab_size: int, max_len: int):
    """A BERT WordPiece tokenizer trained on the cleaned shards: Chinese characters as single tokens (as
    bert-base-chinese has them), other words split into word pieces; lower-cased like the cleaning."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2, show_progress=False)
    tokenizer.train_from_iterator(_cleaned_lines(cleaned_shards(out)), trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer.decoder = decoders.WordPiece()
    return BertTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_len)


def corpus_tokenizer(model: EncoderConfig, out: Path):
    """Pass 2: the tokenizer, saved in ``tokenizer/`` (reused when it is there)."""
    from transformers import AutoTokenizer

    folder = out / TOKENIZER_DIR
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    if model.init_from:
        from training.models.pretrained import load_tokenizer

        tokenizer = load_tokenizer(model.init_from)
    else:
        vocab = model.vocab_size or (SIZES[model.size]["vocab_size"] if model.size in SIZES else
                                     json.loads(Path(model.size).read_text()).get("vocab_size", 21128))
        tokenizer = train_tokenizer(out, vocab, model.max_len)
    if not tokenizer.is_fast:
        raise CorpusError(f"model.init_from: {model.init_from!r}: its tokenizer has no fast (Rust) version; whole-word "
                          "masking needs the token offsets a fast tokenizer gives")
    for name in ("pad_token_id", "mask_token_id"):
        if getattr(tokenizer, name) is None:
            raise CorpusError(f"model.init_from: {model.init_from!r}: its tokenizer has no {name.split('_')[0]} token")
    tmp = folder.with_name(folder.name + ".tmp")
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)
    return tokenizer


# ---- pass 3: tokenize and segment -------------------------------------------------------------------------------
def word_starts(text: str, offsets: list[tuple[int, int]], segment: Callable[[str], list[tuple[str, int, int]]] | None) -> np.ndarray:
    """For each token (by its character offsets): SPECIAL (no characters: [CLS], [SEP]), WORD_START (the first token
    of a jieba word, or of any token when ``segment`` is None) or WORD_INSIDE."""
    flags = np.full(len(offsets), WORD_START, dtype=np.uint8)
    starts = None
    if segment is not None:
        starts = np.zeros(len(text) + 1, dtype=bool)
        for _, begin, _ in segment(text):
            starts[begin] = True
    for i, (begin, end) in enumerate(offsets):
        if end <= begin:
            flags[i] = SPECIAL
        elif starts is not None and not starts[begin] and i > 0 and offsets[i - 1][1] > offsets[i - 1][0]:
            flags[i] = WORD_INSIDE  # a character or word piece inside the word that began before it
    return flags


def sequences(ids: list[int], flags: np.ndarray, max_len: int, cls: int, sep: int) -> Iterator[tuple[list[int], np.ndarray]]:
    """A text's tokens cut into sequences of at most ``max_len`` (each with its own [CLS] ... [SEP]); a cut never
    leaves a sequence starting inside a word."""
    body_ids, body_flags = ids[1:-1], flags[1:-1]
    width = max_len - 2
    for begin in range(0, max(1, len(body_ids)), width):
        part = body_flags[begin:begin + width].copy()
        if len(part):
            part[0] = WORD_START
        yield ([cls] + body_ids[begin:begin + width] + [sep],
               np.concatenate([[SPECIAL], part, [SPECIAL]]).astype(np.uint8))


def _tokenize_shard(args: tuple[str, str, str, int, bool]) -> dict:
    source, target, tokenizer_dir, max_len, whole_word = args
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    segment = None
    if whole_word:
        import jieba

        jieba.setLogLevel(60)
        segment = lambda text: jieba.tokenize(text)  # noqa: E731
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    id_parts, flag_parts, lengths, texts, split = [], [], [], 0, 0
    with open(source, encoding="utf-8") as f:
        while batch := [line.rstrip("\n") for line in itertools.islice(f, 1000)]:  # a thousand texts at a time
            batch = [line for line in batch if line]
            if not batch:
                continue
            encoded = tokenizer(batch, add_special_tokens=True, return_offsets_mapping=True, truncation=False, verbose=False)
            chunk_ids, chunk_flags = [], []
            for text, ids, offsets in zip(batch, encoded["input_ids"], encoded["offset_mapping"]):
                texts += 1
                flags = word_starts(text, offsets, segment)
                parts = list(sequences(ids, flags, max_len, cls, sep))
                split += len(parts) > 1
                for seq_ids, seq_flags in parts:
                    chunk_ids.extend(seq_ids)
                    chunk_flags.append(seq_flags)
                    lengths.append(len(seq_ids))
            id_parts.append(np.asarray(chunk_ids, dtype=np.int32))
            flag_parts.append(np.concatenate(chunk_flags))
    all_ids = np.concatenate(id_parts) if id_parts else np.zeros(0, dtype=np.int32)
    all_flags = np.concatenate(flag_parts) if flag_parts else np.zeros(0, dtype=np.uint8)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    _save_npy(Path(target + ".ids.npy"), all_ids)
    _save_npy(Path(target + ".words.npy"), all_flags)
    _save_npy(Path(target + ".offsets.npy"), offsets)  # last: its presence says the shard is done
    return {"texts": texts, "sequences": len(lengths), "tokens": int(offsets[-1]), "split_texts": split}


def shard_stats(target: Path) -> dict:
    offsets = np.load(str(target) + ".offsets.npy", mmap_mode="r")
    return {"sequences": len(offsets) - 1, "tokens": int(offsets[-1])}


def tokenize_shards(out: Path, model: EncoderConfig, workers: int, progress: Callable[[str], None] = print) -> dict:
    """Pass 3 over every cleaned shard not done yet, ``workers`` at a time; the held-out texts too."""
    todo, totals = [], {"sequences": 0, "tokens": 0, "split_texts": 0}
    jobs = [(p, out / "train" / p.stem) for p in cleaned_shards(out)] + [(out / f"{HELD_OUT}.txt", out / HELD_OUT / "00000")]
    for folder in ("train", HELD_OUT):
        (out / folder).mkdir(exist_ok=True)
    for source, target in jobs:
        if Path(str(target) + ".offsets.npy").is_file():
            continue
        todo.append((str(source), str(target), str(out / TOKENIZER_DIR), model.max_len, model.masking == "wwm"))
    if todo:
        started = time.perf_counter()
        with ProcessPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
            for done, result in enumerate(pool.map(_tokenize_shard, todo), 1):
                totals["split_texts"] += result["split_texts"]
                progress(f"corpus: tokenized shard {done}/{len(todo)} ({result['texts']} texts, {result['tokens']} tokens; "
                         f"{time.perf_counter() - started:.0f}s)")
    train = [shard_stats(t) for _, t in jobs[:-1]]
    return {"shards": len(train), "train_sequences": sum(s["sequences"] for s in train),
            "train_tokens": sum(s["tokens"] for s in train), "held_out_sequences": shard_stats(jobs[-1][1])["sequences"],
            "split_texts": totals["split_texts"]}


def corpus_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        files = [path / "train.jsonl"] if path.is_dir() else [path]
        for file in files:
            h.update(file.name.encode() + b"\0")
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def prepare_corpus(corpus: CorpusConfig, model: EncoderConfig, out_dir: str | Path,
                   progress: Callable[[str], None] = print) -> dict:
    """The three passes into ``out_dir``; the manifest (counts, digests, tokenizer, shards). Idempotent: a finished
    folder is returned as it is, an unfinished one goes on where it stopped."""
    out = Path(out_dir)
    if (out / MANIFEST).is_file():
        return json.loads((out / MANIFEST).read_text())
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    paths = corpus_sources(corpus)
    counts = read_and_clean(corpus, out, progress)
    read_s = time.perf_counter() - started
    tokenizer = corpus_tokenizer(model, out)
    shards = tokenize_shards(out, model, corpus.num_workers or os.cpu_count() or 1, progress)
    from training.models.pretrained import tokenizer_digest

    manifest = {
        "files": [str(p) for p in paths], "digest": corpus_digest(paths), "counts": counts, **shards,
        "masking": model.masking, "max_len": model.max_len,
        "tokenizer": {"source": model.init_from or f"trained on the corpus ({model.size})", "class": type(tokenizer).__name__,
                      "digest": tokenizer_digest(tokenizer), "vocab_size": len(tokenizer), "pad_id": tokenizer.pad_token_id,
                      "mask_id": tokenizer.mask_token_id},
        "exclude_prepared": list(corpus.exclude_prepared), "seconds": {"read_clean": read_s, "total": time.perf_counter() - started},
    }
    if shards["train_sequences"] == 0:
        raise CorpusError(f"{', '.join(map(str, paths))}: no token sequences after tokenization")
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False).encode())
    for path in cleaned_shards(out):  # the token arrays hold it all now
        path.unlink()
    return manifest


class CorpusShards:
    """The token sequences of a prepared corpus (``train`` or ``heldout``), memory-mapped: indexing reads one sequence."""

    def __init__(self, out_dir: str | Path, part: str = "train"):
        folder = Path(out_dir) / part
        self.shards = []
        for offsets in sorted(folder.glob("*.offsets.npy")):
            stem = str(offsets)[: -len(".offsets.npy")]
            self.shards.append((np.load(stem + ".ids.npy", mmap_mode="r"), np.load(stem + ".words.npy", mmap_mode="r"),
                                np.load(offsets, mmap_mode="r")))
        self.starts = np.cumsum([0] + [len(s[2]) - 1 for s in self.shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        ids, words, offsets = self.shards[shard]
        row = index - self.starts[shard]
        begin, end = offsets[row], offsets[row + 1]
        return np.asarray(ids[begin:end], dtype=np.int64), np.asarray(words[begin:end])
