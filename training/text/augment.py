"""EDA-style augmentation of segmented training texts (train split only).

Four operations, each with its own probability, act on a list of tokens:
synonym replacement (each token, p_synonym), random insertion of a synonym
(for each token that has synonyms, p_insert), random swap (each token swaps
with another position, p_swap) and random deletion (each token, p_delete).
One `random.Random(seed)` drives a call, so the same inputs and seed give the
same copies on any machine.

    from training.text.augment import augment_texts, load_synonyms
    synonyms = load_synonyms(None)  # the built-in table
    new_tokens, new_labels = augment_texts([["质量", "很", "好"]], ["pos"], n_aug=2, seed=13, synonyms=synonyms)

Synonym table format (the built-in one is `training/text/synonyms.txt`):
UTF-8 text, one group of synonyms per line, words separated by whitespace;
`#` starts a comment; every word in a group maps to the others.

    # price
    便宜 实惠 划算
    快 迅速 快速

Negation words (不 没 没有 无 ...) are never deleted, swapped, replaced or
offered as a synonym: moving or dropping one flips the label of a review
("不 喜欢" -> "喜欢"), which would teach the model the opposite.
"""

from __future__ import annotations

import random
from importlib import resources
from pathlib import Path
from typing import Sequence

# Tokens whose loss or move flips the meaning; jieba keeps these whole.
NEGATIONS = frozenset(
    "不 没 没有 无 非 未 别 勿 莫 毋 甭 不是 不能 不会 不要 不用 不想 不了 不到 不够 不太 不如 不必 "
    "没什么 无法 毫无 并非 从不 从未 绝不 决不 未必".split()
)


def _parse_synonyms(data: bytes, source: str) -> dict[str, list[str]]:
    groups: dict[str, set[str]] = {}
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{source}, line {lineno}: not UTF-8 text ({err.reason})") from None
        if lineno == 1:
            line = line.removeprefix("\ufeff")  # a BOM from Windows editors
        words = list(dict.fromkeys(line.split("#", 1)[0].split()))
        if not words:
            continue
        if len(words) < 2:
            raise ValueError(f"{source}, line {lineno}: a synonym group needs at least two words, got {words[0]!r}")
        for word in words:
            groups.setdefault(word, set()).update(w for w in words if w != word)
    # sorted lists: the rng picks by index, so order must not depend on the file layout
    return {word: sorted(others) for word, others in sorted(groups.items())}


def load_synonyms(path: str | Path | None) -> dict[str, list[str]]:
    """Synonym table from a file in the format above; None or "" gives the built-in table."""
    if path is None or str(path) == "":
        return load_builtin_synonyms()
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read synonym table {path}: {err.strerror}") from None
    return _parse_synonyms(data, str(path))


def load_builtin_synonyms() -> dict[str, list[str]]:
    """The hand-written table of common review words shipped with zhflow."""
    data = resources.files("training.text").joinpath("synonyms.txt").read_bytes()
    return _parse_synonyms(data, "training/text/synonyms.txt")


def _candidates(word: str, synonyms: dict[str, list[str]]) -> list[str]:
    if word in NEGATIONS:
        return []
    # sorted again: a caller's own dict may hold lists in any order
    return sorted({s for s in synonyms.get(word, ()) if s != word and s not in NEGATIONS})


def augment_tokens(
    tokens: list[str],
    synonyms: dict[str, list[str]],
    rng: random.Random,
    p_delete: float = 0.1,
    p_swap: float = 0.1,
    p_insert: float = 0.1,
    p_synonym: float = 0.1,
) -> list[str]:
    """One augmented copy of `tokens` (never empty when `tokens` is not)."""
    if not tokens:
        return []
    # insertion draws from the words of the input, so it only ever adds their synonyms
    originals = list(tokens)

    out = []
    for tok in originals:
        choices = _candidates(tok, synonyms)
        out.append(rng.choice(choices) if choices and rng.random() < p_synonym else tok)

    for tok in originals:
        choices = _candidates(tok, synonyms)
        if choices and rng.random() < p_insert:
            out.insert(rng.randrange(len(out) + 1), rng.choice(choices))

    # negations stay where they are: moved, they would negate another word
    movable = [i for i, tok in enumerate(out) if tok not in NEGATIONS]
    if len(movable) >= 2:
        for pos, i in enumerate(movable):
            if rng.random() < p_swap:
                other = rng.randrange(len(movable) - 1)  # any movable position but this one
                j = movable[other + (other >= pos)]
                out[i], out[j] = out[j], out[i]

    kept = [tok for tok in out if tok in NEGATIONS or rng.random() >= p_delete]
    if not kept:
        kept = [rng.choice(out)]
    return kept


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be between 0 and 1, got {value}")


def augment_texts(
    token_lists: Sequence[list[str]],
    labels: Sequence,
    n_aug: int,
    seed: int,
    synonyms: dict[str, list[str]],
    *,
    p_delete: float = 0.1,
    p_swap: float = 0.1,
    p_insert: float = 0.1,
    p_synonym: float = 0.1,
) -> tuple[list[list[str]], list]:
    """Up to `n_aug` new copies per text, with their labels; the originals are not returned.

    A copy equal to its original or to an earlier copy is dropped, so a text
    with nothing to change (one token, no synonyms) adds nothing.
    """
    if len(token_lists) != len(labels):
        raise ValueError(f"got {len(token_lists)} token lists but {len(labels)} labels")
    if n_aug < 0:
        raise ValueError(f"n_aug must be >= 0, got {n_aug}")
    probs = {"p_delete": p_delete, "p_swap": p_swap, "p_insert": p_insert, "p_synonym": p_synonym}
    for name, value in probs.items():
        _check_probability(name, value)

    rng = random.Random(seed)
    new_tokens: list[list[str]] = []
    new_labels: list = []
    for tokens, label in zip(token_lists, labels):
        seen = {tuple(tokens)}
        for _ in range(n_aug):
            copy = augment_tokens(list(tokens), synonyms, rng, **probs)
            key = tuple(copy)
            if copy and key not in seen:
                seen.add(key)
                new_tokens.append(copy)
                new_labels.append(label)
    return new_tokens, new_labels


def span_samples(token_lists: Sequence[list[str]], n_spans: int, seed: int) -> list[list[str]]:
    """Up to ``n_spans`` runs of consecutive tokens of each text, for a distillation transfer set (the n-gram sampling
    of Tang et al., 2019): half of them 1 to 5 tokens long, what a phrase says; half a third to four fifths of the
    text, what a clause says. A teacher labels them; they have no label of their own (a part of a review can say the
    opposite of the whole). A run equal to a text of ``token_lists`` or to an earlier run is dropped; a text of fewer
    than 3 tokens gives none."""
    if n_spans < 0:
        raise ValueError(f"n_spans must be >= 0, got {n_spans}")
    rng = random.Random(seed)
    seen = {tuple(tokens) for tokens in token_lists}
    out: list[list[str]] = []
    for tokens in token_lists:
        n = len(tokens)
        if n < 3:
            continue
        for _ in range(n_spans):
            if rng.random() < 0.5:
                length = rng.randint(1, min(5, n - 1))
            else:
                length = rng.randint(max(2, n // 3), max(2, n * 4 // 5))
            start = rng.randint(0, n - length)
            span = tokens[start:start + length]
            key = tuple(span)
            if key not in seen and len("".join(span)) >= 2:
                seen.add(key)
                out.append(span)
    return out
