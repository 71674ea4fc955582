"""Normalisation of raw Chinese text.

NFKC folds full-width forms to half-width (ＡＢＣ１２３！ -> abc123!); zero-width
and control characters and lone surrogates are removed; URLs, e-mail
addresses and runs of 5+ digits optionally become placeholder tokens; emoji
are kept or removed; traditional characters optionally become simplified
(OpenCC); whitespace runs (tabs, line breaks, form feeds) become one space;
letters are lower-cased. Without the OpenCC step, the result only holds
characters of the input, once the removed ones are gone, NFKC-normalised and
lower-cased; spaces; and the placeholders.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

URL_TOKEN = "<url>"
EMAIL_TOKEN = "<email>"
NUM_TOKEN = "<num>"
PLACEHOLDERS = (URL_TOKEN, EMAIL_TOKEN, NUM_TOKEN)

_URL = re.compile(r"(?:https?://|ftp://|www\.)[^\s\u3000-\u303f\uff00-\uffef\u4e00-\u9fff]+", re.IGNORECASE)
# ASCII only, and never starting inside a run: Chinese text around an address stays, and a long line costs O(n), not O(n^2)
_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+", re.ASCII)
_LONG_NUMBER = re.compile(r"\d{5,}")
_ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad]")
_SURROGATES = re.compile("[\ud800-\udfff]")
_SPACES = re.compile(r"\s+")
# keycaps (1️⃣: the digit goes with its keycap), pictographs, symbols, dingbats, flags, skin tones, variation selector 16
_EMOJI = re.compile("[0-9#*]\uFE0F?\u20E3|[\U0001F000-\U0001FAFF\U0001F1E6-\U0001F1FF\u2600-\u27BF\u2B00-\u2BFF\uFE0F\u20E3]")


def _drop_control(text: str) -> str:
    # Cc (controls), Cf (format), Co (private use), Cn (unassigned); whitespace (\f and \x85 are Cc too) is kept
    # for the space rule, so that it still separates words
    if _SPACES.sub(" ", text).isprintable():  # the common case, in C: nothing to drop
        return text
    return "".join(ch for ch in text if ch.isspace() or unicodedata.category(ch) not in ("Cc", "Cf", "Co", "Cn"))


@lru_cache(maxsize=1)
def _t2s():
    try:
        import opencc
    except ImportError as err:  # an optional extra
        raise ValueError("preprocess.traditional_to_simplified needs OpenCC: pip install opencc") from err
    return opencc.OpenCC("t2s")


def normalize(
    text: str,
    replace_urls: bool = True,
    replace_numbers: bool = False,
    emoji: str = "keep",
    traditional_to_simplified: bool = False,
) -> str:
    """Return the cleaned form of ``text`` ('' when nothing is left); idempotent."""
    # removals first: a dropped character between a letter and its accent must not keep NFKC from joining them
    text = _SURROGATES.sub("", text)
    text = _ZERO_WIDTH.sub("", text)
    text = _drop_control(text)
    text = unicodedata.normalize("NFKC", text).lower()
    for _ in range(3):  # lower() can leave text that NFKC changes again (and back): settle it
        if unicodedata.is_normalized("NFKC", text) and text == text.lower():
            break
        text = unicodedata.normalize("NFKC", text).lower()
    if emoji == "remove":
        text = _EMOJI.sub(" ", text)
    if traditional_to_simplified:
        text = _t2s().convert(text)
    if replace_urls:
        text = _EMAIL.sub(f" {EMAIL_TOKEN} ", text)
        text = _URL.sub(f" {URL_TOKEN} ", text)
    if replace_numbers:
        text = _LONG_NUMBER.sub(f" {NUM_TOKEN} ", text)
    return _SPACES.sub(" ", text).strip()


def normalizer(pre) -> "callable":
    """``normalize`` with the options of a PreprocessConfig bound."""
    return lambda text: normalize(text, pre.replace_urls, pre.replace_numbers, pre.emoji, pre.traditional_to_simplified)
