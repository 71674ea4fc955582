"""Word segmentation (jieba) or character tokens, with stop words.

Segmentation runs in a pool of spawned processes for large inputs; each
process loads jieba's dictionary once.

    from training.text.segment import segment_texts
    segment_texts(["这本书非常好看"], segmenter="jieba")  # [['这', '本书', '非常', '好看']]
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import re
import sys
from functools import lru_cache
from importlib import resources
from typing import Iterable, Sequence

from training.text.clean import EMAIL_TOKEN, URL_TOKEN

_PLACEHOLDERS = re.compile(f"({re.escape(URL_TOKEN)}|{re.escape(EMAIL_TOKEN)})")
_SERIAL_BELOW = 2000  # below this many texts a pool costs more than it saves


@lru_cache(maxsize=None)
def load_stopwords(kind: str = "builtin") -> frozenset[str]:
    if kind == "none":
        return frozenset()
    if kind != "builtin":
        raise ValueError(f"unknown stop word list {kind!r}; use 'builtin' or 'none'")
    text = resources.files("training.text").joinpath("stopwords.txt").read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


@lru_cache(maxsize=1)
def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)
    jieba.initialize()
    return jieba


def tokenize(text: str, segmenter: str = "jieba", stopwords: frozenset[str] = frozenset()) -> list[str]:
    """Tokens of one normalised text; placeholders such as <url> stay whole."""
    tokens: list[str] = []
    for piece in _PLACEHOLDERS.split(text):
        if not piece:
            continue
        if piece in (URL_TOKEN, EMAIL_TOKEN):
            tokens.append(piece)
        elif segmenter == "char":
            tokens.extend(ch for ch in piece if not ch.isspace())
        elif segmenter == "jieba":
            tokens.extend(t for t in _jieba().lcut(piece) if t.strip())
        else:
            raise ValueError(f"unknown segmenter {segmenter!r}; use 'jieba' or 'char'")
    return [t for t in tokens if t not in stopwords]


def _segment_chunk(args: tuple[Sequence[str], str, str]) -> list[list[str]]:
    texts, segmenter, stopword_kind = args
    stop = load_stopwords(stopword_kind)
    return [tokenize(t, segmenter, stop) for t in texts]


def _chunks(items: Sequence[str], size: int) -> Iterable[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def segment_texts(
    texts: Sequence[str],
    segmenter: str = "jieba",
    stopwords: str = "builtin",
    num_workers: int = 1,
    progress: bool = False,
    chunk_size: int = 500,
) -> list[list[str]]:
    """Segment many texts, in ``num_workers`` processes when it pays off; order is kept."""
    chunks = [(chunk, segmenter, stopwords) for chunk in _chunks(list(texts), chunk_size)]
    out: list[list[str]] = []
    with _progress(progress, len(texts)) as advance:
        if num_workers <= 1 or len(texts) < _SERIAL_BELOW:
            for chunk in chunks:
                out.extend(_segment_chunk(chunk))
                advance(len(chunk[0]))
        else:
            # spawn, not fork: the caller may hold threads (Prefect, MLflow) that fork would copy mid-lock
            with mp.get_context("spawn").Pool(num_workers) as pool:
                for chunk, result in zip(chunks, pool.imap(_segment_chunk, chunks)):
                    out.extend(result)
                    advance(len(chunk[0]))
    return out


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
