"""Normalisation of raw Chinese text.

NFKC folds full-width forms to half-width (ＡＢＣ１２３！ -> ABC123!); zero-width
and control characters and lone surrogates are removed; URLs and e-mail
addresses optionally become placeholder tokens; whitespace runs become one
space; Latin letters are lower-cased.
"""

from __future__ import annotations

import re
import unicodedata

URL_TOKEN = "<url>"
EMAIL_TOKEN = "<email>"

_URL = re.compile(r"(?:https?://|ftp://|www\.)[^\s\u3000-\u303f\uff00-\uffef\u4e00-\u9fff]+", re.IGNORECASE)
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad]")
_SURROGATES = re.compile("[\ud800-\udfff]")
_SPACES = re.compile(r"\s+")


def _drop_control(text: str) -> str:
    # Cc (controls) and Cf (format) except ordinary whitespace, which the space rule handles.
    return "".join(
        ch for ch in text if ch in "\t\n\r " or unicodedata.category(ch) not in ("Cc", "Cf", "Co", "Cn")
    )


def normalize(text: str, replace_urls: bool = True) -> str:
    """Return the cleaned form of ``text`` ('' when nothing is left)."""
    text = _SURROGATES.sub("", text)
    text = unicodedata.normalize("NFKC", text)
    text = _ZERO_WIDTH.sub("", text)
    text = _drop_control(text)
    if replace_urls:
        text = _EMAIL.sub(f" {EMAIL_TOKEN} ", text)
        text = _URL.sub(f" {URL_TOKEN} ", text)
    return _SPACES.sub(" ", text).strip().lower()
