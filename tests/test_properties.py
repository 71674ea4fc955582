"""Properties of normalisation and segmentation on arbitrary text (hypothesis).

normalize: never raises; idempotent; the result holds only characters of the input once the removed ones (control,
format, private-use, unassigned, surrogate) are gone, NFKC-normalised and lower-cased, single inner spaces and the
placeholders (its module docstring), and none of the removed kinds;
every whitespace character separates words as a space does; no Chinese character is lost.
Segmenter.tokenize, for every backend: never raises; tokens are non-empty and hold no whitespace; with no stop
words they join back to the text's first MAX_TEXT_CHARS characters without whitespace and lone surrogates (the
module docstring of training/text/segment.py); stop words only ever remove whole tokens.
"""

import re
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training.text.clean import PLACEHOLDERS, normalize
from training.text.segment import BACKENDS, MAX_TEXT_CHARS, Segmenter, load_stopwords

# no example database: nothing written into the checkout; no deadline: jieba's first load takes a second
FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

EMOJI_PARTS = ["👍", "🏽", "👨", "👩", "👧", "\u200d", "\ufe0f", "\u20e3", "🇨", "🇳", "☺", "⭐", "\U000e0067", "\U000e007f"]
FRAGMENTS = ["http://", "https://", "www.", "@", ".com", "qq", "abc", "12345", "2023", " ", "<url>", "<email>", "<num>",
             "<", ">", "。", "，", "！", "e\u0301", "\u0130", "\u1e9e", "ﬁ", "ｗｗｗ", "１２３４５", "＠",
             "abc@qq.com", "x.y+z@mail.example.org", "http://a.cn/x?y=1", "www.example.com"]
WHITESPACE = [chr(c) for c in range(0x110000) if chr(c).isspace()]
DROPPED = ["\u200b", "\u200d", "\u00ad", "\ufeff", "\x00", "\x07", "\U000e0067", "\ue000", "\ud800"]

any_codepoint = st.integers(0, 0x10FFFF).map(chr)  # surrogates, unassigned and private-use included
messy_char = st.one_of(
    st.characters(),  # hypothesis's default: every category but surrogates
    st.characters(categories=["Cs"]),  # lone surrogates
    st.characters(categories=["Cc", "Cf", "Co", "Zs", "Zl", "Zp", "Mn", "Me"]),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0xFF01, max_codepoint=0xFF5E),  # full-width forms
    st.characters(min_codepoint=0x0400, max_codepoint=0x04FF),  # Cyrillic
    st.sampled_from(WHITESPACE + DROPPED),
    st.sampled_from(EMOJI_PARTS),
    any_codepoint,
    # a character normalize drops, between a letter and an accent that NFKC would join to it
    st.tuples(st.sampled_from("aeiouy"), st.sampled_from(DROPPED), st.sampled_from("\u0300\u0301\u0308")).map("".join),
)
messy_text = st.lists(st.one_of(messy_char, st.sampled_from(FRAGMENTS)), max_size=40).map("".join)
options = st.fixed_dictionaries({
    "replace_urls": st.booleans(), "replace_numbers": st.booleans(), "emoji": st.sampled_from(["keep", "remove"]),
})
PLACEHOLDER_CHARS = set("".join(PLACEHOLDERS)) | {" "}
_WHITESPACE = re.compile(r"\s")
_SURROGATE = re.compile("[\ud800-\udfff]")
_CJK = re.compile("[\u4e00-\u9fff]")


@FAST
@given(st.one_of(messy_text, st.text(), st.text(any_codepoint, max_size=30)), options)
def test_normalize_never_raises_and_is_idempotent(text, opts):
    once = normalize(text, **opts)
    assert isinstance(once, str)
    assert normalize(once, **opts) == once


@settings(FAST, max_examples=300)
@given(messy_text, options)
def test_normalize_keeps_only_input_characters_spaces_and_placeholders(text, opts):
    out = normalize(text, **opts)
    kept = "".join(ch for ch in text if ch.isspace() or unicodedata.category(ch) not in ("Cc", "Cf", "Co", "Cn", "Cs"))
    assert set(out) <= set(unicodedata.normalize("NFKC", kept).lower()) | PLACEHOLDER_CHARS
    assert out == out.strip() and "  " not in out
    assert not any(ch.isspace() and ch != " " for ch in out)
    assert not any(unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cn", "Cs") for ch in out)


@settings(FAST, max_examples=200)
@given(messy_text, messy_text, st.sampled_from(WHITESPACE), options)
def test_every_whitespace_character_separates_like_a_space(before, after, space, opts):
    assert normalize(before + space + after, **opts) == normalize(before + " " + after, **opts)


@settings(FAST, max_examples=200)
@given(messy_text, options)
def test_chinese_characters_are_never_lost(text, opts):
    """URLs, addresses and numbers are ASCII: a placeholder never takes the Chinese text around it."""
    folded = unicodedata.normalize("NFKC", _SURROGATE.sub("", text))
    assert _CJK.findall(normalize(text, **opts)) == _CJK.findall(folded)


@settings(FAST, max_examples=50)
@given(st.lists(st.one_of(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), messy_char), max_size=20).map("".join))
def test_traditional_to_simplified_never_raises_and_is_idempotent(text):
    out = normalize(text, traditional_to_simplified=True)
    assert out == out.strip() and "  " not in out
    assert normalize(out, traditional_to_simplified=True) == out


def _check_tokens(tokens: list[str], text: str) -> None:
    assert all(isinstance(t, str) and t for t in tokens)
    assert not any(_WHITESPACE.search(t) for t in tokens)
    assert "".join(tokens) == _WHITESPACE.sub("", _SURROGATE.sub("", text[:MAX_TEXT_CHARS]))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(FAST, max_examples=100)
@given(text=st.one_of(messy_text, st.text(any_codepoint, max_size=30)))
def test_segment_normalised_text_joins_back(backend, text):
    clean = normalize(text)
    _check_tokens(Segmenter(backend, "none").tokenize(clean), clean)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(FAST, max_examples=100)
@given(text=st.one_of(messy_text, st.text(any_codepoint, max_size=30)))
def test_segment_raw_text_never_raises_and_joins_back(backend, text):
    """tokenize is meant for normalised text, but raw text (surrogates, controls, tabs) must not break it either."""
    _check_tokens(Segmenter(backend, "none").tokenize(text), text)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(FAST, max_examples=50)
@given(text=messy_text)
def test_stop_words_remove_whole_tokens_only(backend, text):
    clean = normalize(text)
    every = Segmenter(backend, "none").tokenize(clean)
    stop = load_stopwords("builtin")
    assert Segmenter(backend, "builtin").tokenize(clean) == [t for t in every if t not in stop]
