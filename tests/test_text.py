import pytest

from training.text.clean import EMAIL_TOKEN, URL_TOKEN, normalize
from training.text.segment import Segmenter, load_stopwords


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("ＡＢＣ１２３！", "abc123!"),  # full-width -> half-width, lower-cased
        ("  好看\t\t值得\n一读  ", "好看 值得 一读"),
        ("好\u200b看\u200d", "好看"),  # zero-width characters
        ("好\x00看\x07", "好看"),  # control characters
        ("好看\ud800", "好看"),  # lone surrogate
        ("", ""),
        ("   \u3000 ", ""),  # ideographic space only
    ],
)
def test_normalize(raw, expected):
    assert normalize(raw) == expected


def test_urls_and_emails_become_placeholders():
    text = normalize("详见 https://example.com/a?b=1 或写信 someone@example.org 谢谢")
    assert URL_TOKEN in text and EMAIL_TOKEN in text
    assert "example" not in text
    assert "example.com" in normalize("见 https://example.com", replace_urls=False)


def test_normalize_is_idempotent():
    for raw in ["ＡＢＣ 好看\u200b http://x.cn/y", "质量太差了，很失望！！", "a@b.com <url>"]:
        once = normalize(raw)
        assert normalize(once) == once


def test_jieba_keeps_words_and_placeholders():
    tokens = Segmenter("jieba").tokenize(normalize("这本书非常好看 www.example.com"))
    assert "好看" in tokens and "非常" in tokens
    assert URL_TOKEN in tokens  # not split into '<', 'url', '>'
    assert "这" not in tokens  # a stop word


def test_negations_are_not_stop_words():
    stop = load_stopwords()
    for word in ["不", "没", "没有", "很", "太", "非常"]:
        assert word not in stop
    assert "不" in Segmenter().tokenize("不好看") or "不好" in Segmenter().tokenize("不好看")


def test_char_segmenter():
    assert Segmenter("char", "none").tokenize("好 看!") == ["好", "看", "!"]


def test_unknown_segmenter_names_itself():
    with pytest.raises(ValueError, match="segmenter 'bpe'"):
        Segmenter("bpe").tokenize("好看")


def test_parallel_segmentation_matches_serial():
    texts = [f"第{i}本书非常好看，值得一读，质量太差了" for i in range(2500)]
    serial = Segmenter("jieba", "builtin").segment(texts, num_workers=1)
    parallel = Segmenter("jieba", "builtin").segment(texts, num_workers=2)
    assert parallel == serial
    assert len(serial) == len(texts)
