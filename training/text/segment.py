"""Word segmentation and stop words.

Backends: ``jieba`` (the reference), ``rjieba`` (its Rust port: the same
dictionary and algorithm, about 10x faster, agreeing with jieba on ~98% of the
built-in corpus's texts) and ``char`` (one token per character). Large inputs
are segmented in a pool of processes, in chunks; the segmenter (dictionary,
user dictionary) is built once per process, or once before forking on Linux.

The tokens of a text, joined, give back its first 100,000 characters with the
whitespace, the lone surrogates and the stop words left out.

    from training.text.segment import Segmenter
    Segmenter("jieba").tokenize("这本书非常好看")  # ['本书', '非常', '好看']  ('这' is a stop word)
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import re
import signal
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable, Optional, Sequence

from training.text.clean import PLACEHOLDERS

_PLACEHOLDERS = re.compile("(" + "|".join(re.escape(p) for p in PLACEHOLDERS) + ")")
_SURROGATES = re.compile("[\ud800-\udfff]")  # not text: rjieba cannot take them, no file can hold them
# No model reads further (max_len <= 4096 tokens, max_char_len <= 8192 characters), and jieba's time and memory
# grow with a run of text without punctuation (a 10 MB line of Chinese: about 25 s and 1.4 GB on one core).
MAX_TEXT_CHARS = 100_000
_SERIAL_BELOW = 2000  # below this many texts a pool costs more than it saves
BACKENDS = ("jieba", "rjieba", "char")


def _read_lines(path: str | os.PathLike, what: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path}: not valid UTF-8 ({err.reason})") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@lru_cache(maxsize=None)
def load_stopwords(kind: str = "builtin", extra_file: Optional[str] = None) -> frozenset[str]:
    if kind not in ("builtin", "none"):
        raise ValueError(f"unknown stop word list {kind!r}; use 'builtin' or 'none'")
    words: set[str] = set()
    if kind == "builtin":
        text = resources.files("training.text").joinpath("stopwords.txt").read_text(encoding="utf-8")
        words |= {line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")}
    if extra_file:
        words |= set(_read_lines(extra_file, "stop-word file"))
    return frozenset(words)


def file_digest(path: Optional[str]) -> Optional[str]:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


def jieba_cache_dir() -> Path:
    """jieba's dictionary cache goes to a private folder, not a shared /tmp file."""
    root = os.environ.get("ZHFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zhflow")
    path = Path(root) / "jieba"
    path.mkdir(parents=True, exist_ok=True)
    return path


@lru_cache(maxsize=4)
def _cutter(backend: str, user_dict: Optional[str], hmm: bool):
    if backend == "jieba":
        import jieba

        jieba.setLogLevel(logging.WARNING)
        tokenizer = jieba.Tokenizer()
        tokenizer.tmp_dir = str(jieba_cache_dir())
        tokenizer.initialize()
        if user_dict:
            _read_lines(user_dict, "user dictionary")  # a clear error before jieba's own
            tokenizer.load_userdict(user_dict)
        return lambda text: tokenizer.lcut(text, HMM=hmm)
    if backend == "rjieba":
        import rjieba

        tokenizer = rjieba.Jieba()
        for line in _read_lines(user_dict, "user dictionary") if user_dict else []:
            parts = line.split()
            freq = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 1_000
            tokenizer.add_word(parts[0], freq, parts[2] if len(parts) > 2 else None)
        return lambda text: tokenizer.cut(text, hmm)
    if backend == "char":
        return lambda text: list(text)
    raise ValueError(f"unknown segmenter {backend!r}; use one of {', '.join(BACKENDS)}")


@dataclass(frozen=True)
class Segmenter:
    """A picklable description of how to tokenise; the heavy segmenter is built lazily per process."""

    backend: str = "jieba"
    stopwords: str = "builtin"
    stopwords_file: Optional[str] = None
    user_dict: Optional[str] = None
    hmm: bool = True

    @classmethod
    def from_config(cls, pre) -> "Segmenter":
        return cls(pre.segmenter, pre.stopwords, pre.stopwords_file, pre.user_dict, pre.jieba_hmm)

    def tokenize(self, text: str) -> list[str]:
        """Tokens of one normalised text (its first MAX_TEXT_CHARS characters); placeholders such as <url> stay
        whole, stop words go."""
        cut = _cutter(self.backend, self.user_dict, self.hmm)
        stop = load_stopwords(self.stopwords, self.stopwords_file)
        tokens: list[str] = []
        for piece in _PLACEHOLDERS.split(_SURROGATES.sub("", text[:MAX_TEXT_CHARS])):
            if piece in PLACEHOLDERS:
                tokens.append(piece)
            elif piece:
                tokens.extend(t for t in cut(piece) if t.strip())
        return [t for t in tokens if t not in stop]

    def segment(self, texts: Sequence[str], num_workers: int = 1, progress: bool = False,
                chunk_size: int = 500) -> list[list[str]]:
        """Segment many texts, in ``num_workers`` processes when it pays off; order is kept."""
        chunks = [(self, chunk) for chunk in _chunks(list(texts), chunk_size)]
        out: list[list[str]] = []
        with _progress(progress, len(texts)) as advance:
            if num_workers <= 1 or len(texts) < _SERIAL_BELOW:
                for chunk in chunks:
                    out.extend(_segment_chunk(chunk))
                    advance(len(chunk[1]))
            else:
                with _pool_context(self).Pool(num_workers, initializer=_child_signals) as pool:
                    for chunk, result in zip(chunks, pool.imap(_segment_chunk, chunks)):
                        out.extend(result)
                        advance(len(chunk[1]))
                    pool.close()  # let the workers finish and exit: no SIGTERM to them on the way out
                    pool.join()
        return out


def _child_signals() -> None:
    """A forked worker keeps the parent's Python signal handlers (Prefect's, for one): give SIGTERM and SIGINT back
    their defaults, so the pool can always end its workers."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which ends the pool


def _pool_context(segmenter: Segmenter):
    """fork on Linux, with the dictionaries loaded first: children inherit them and start in milliseconds.

    The children only segment (no logging, no I/O, no locks of the parent's threads), which is what makes
    fork safe here; elsewhere spawn, and each process loads its dictionaries once.
    """
    if sys.platform.startswith("linux"):
        _cutter(segmenter.backend, segmenter.user_dict, segmenter.hmm)
        load_stopwords(segmenter.stopwords, segmenter.stopwords_file)
        return mp.get_context("fork")
    return mp.get_context("spawn")


def _segment_chunk(args: tuple[Segmenter, Sequence[str]]) -> list[list[str]]:
    segmenter, texts = args
    return [segmenter.tokenize(t) for t in texts]


def _chunks(items: Sequence[str], size: int) -> Iterable[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class _progress:
    """A rich progress bar on a terminal; nothing otherwise."""

    def __init__(self, enabled: bool, total: int):
        self.enabled = enabled and sys.stderr.isatty()
        self.total = total

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.progress import Progress

        self._bar = Progress(transient=True)
        self._bar.start()
        task = self._bar.add_task("segmenting", total=self.total)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc):
        if self.enabled:
            self._bar.stop()
        return False
