import random
from collections import Counter

import pytest

from training.text.augment import NEGATIONS, augment_texts, augment_tokens, load_builtin_synonyms, load_synonyms, span_samples

SYNONYMS = {
    "好": ["棒", "不错"],
    "棒": ["好", "不错"],
    "不错": ["好", "棒"],
    "便宜": ["实惠"],
    "实惠": ["便宜"],
    "不": ["没"],  # a careless table: negations must still never be swapped in or out
    "喜欢": ["不", "喜爱"],
    "喜爱": ["喜欢"],
}
TOKENS = ["价格", "便宜", "质量", "很", "好", "我", "不", "喜欢", "包装"]
TEXTS = [TOKENS, ["好"], ["物流", "快", "不错"], ["没有", "问题"]]
LABELS = ["pos", "pos", "pos", "neg"]


def only(op: str) -> dict:
    probs = {"p_delete": 0.0, "p_swap": 0.0, "p_insert": 0.0, "p_synonym": 0.0}
    probs[op] = 1.0
    return probs


def synonyms_of_present(tokens):
    return {s for t in tokens for s in SYNONYMS.get(t, [])} - NEGATIONS


def test_same_seed_same_output_other_seed_differs():
    probs = {"p_delete": 0.2, "p_swap": 0.2, "p_insert": 0.2, "p_synonym": 0.3}
    first = augment_texts(TEXTS, LABELS, n_aug=4, seed=7, synonyms=SYNONYMS, **probs)
    again = augment_texts(TEXTS, LABELS, n_aug=4, seed=7, synonyms=SYNONYMS, **probs)
    other = augment_texts(TEXTS, LABELS, n_aug=4, seed=8, synonyms=SYNONYMS, **probs)
    assert first == again
    assert first[0] != other[0]


def test_deletion_shortens_but_never_empties():
    rng = random.Random(0)
    out = augment_tokens(TOKENS, SYNONYMS, rng, **only("p_delete"))
    assert out == ["不"]  # everything but the negation goes
    for seed in range(20):
        out = augment_tokens(["质量", "很", "好"], SYNONYMS, random.Random(seed), **only("p_delete"))
        assert len(out) == 1 and out[0] in {"质量", "很", "好"}


def test_swap_keeps_the_multiset_and_the_negation_in_place():
    out = augment_tokens(TOKENS, SYNONYMS, random.Random(1), **only("p_swap"))
    assert Counter(out) == Counter(TOKENS)
    assert out != TOKENS
    assert out.index("不") == TOKENS.index("不")


def test_insertion_adds_only_synonyms_of_words_present():
    for seed in range(10):
        out = augment_tokens(TOKENS, SYNONYMS, random.Random(seed), **only("p_insert"))
        added = Counter(out) - Counter(TOKENS)
        assert sum(added.values()) == 3  # one per token that has synonyms: 便宜, 好, 喜欢
        assert set(added) <= synonyms_of_present(TOKENS)
        assert not (Counter(TOKENS) - Counter(out))  # nothing lost


def test_synonym_replacement_uses_only_table_synonyms():
    for seed in range(10):
        out = augment_tokens(TOKENS, SYNONYMS, random.Random(seed), **only("p_synonym"))
        assert len(out) == len(TOKENS)
        for before, after in zip(TOKENS, out):
            if SYNONYMS.get(before) and before not in NEGATIONS:
                assert after in SYNONYMS[before] and after not in NEGATIONS
            else:
                assert after == before


def test_negations_survive_every_operation():
    probs = {"p_delete": 1.0, "p_swap": 1.0, "p_insert": 1.0, "p_synonym": 1.0}
    for seed in range(20):
        out = augment_tokens(["我", "不", "喜欢", "没有", "问题"], SYNONYMS, random.Random(seed), **probs)
        assert out.count("不") == 1 and out.count("没有") == 1
        assert "没" not in out  # never offered as a synonym


def test_at_most_n_aug_copies_none_equal_to_the_original_or_each_other():
    probs = {"p_delete": 0.3, "p_swap": 0.3, "p_insert": 0.3, "p_synonym": 0.3}
    ids = list(range(len(TEXTS)))  # one label per text, to tell the copies apart
    new, labels = augment_texts(TEXTS, ids, n_aug=3, seed=13, synonyms=SYNONYMS, **probs)
    assert len(new) == len(labels) > 0
    for i, text in enumerate(TEXTS):
        copies = [tuple(c) for c, lab in zip(new, labels) if lab == i]
        assert len(copies) <= 3
        assert tuple(text) not in copies
        assert len(set(copies)) == len(copies)
    assert all(new)


def test_copies_per_text_and_labels_follow():
    new, labels = augment_texts([TOKENS, ["好"]], ["pos", "neg"], n_aug=5, seed=3, synonyms=SYNONYMS, **only("p_synonym"))
    # "好" alone has two synonyms, so at most two distinct copies; TOKENS has up to 5
    assert labels.count("neg") <= 2 and labels.count("pos") <= 5
    assert all(c in (["棒"], ["不错"]) for c, lab in zip(new, labels) if lab == "neg")


def test_nothing_to_change_adds_nothing():
    new, labels = augment_texts([["物流"]], ["pos"], n_aug=4, seed=0, synonyms=SYNONYMS)
    assert new == [] and labels == []


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="labels"):
        augment_texts(TEXTS, LABELS[:2], n_aug=1, seed=0, synonyms=SYNONYMS)
    with pytest.raises(ValueError, match="p_swap"):
        augment_texts(TEXTS, LABELS, n_aug=1, seed=0, synonyms=SYNONYMS, p_swap=1.5)


def test_load_synonyms_format(tmp_path):
    path = tmp_path / "syn.txt"
    path.write_text("# a comment\n好 棒  不错  # trailing comment\n\n便宜\t实惠\n好 赞\n", encoding="utf-8")
    table = load_synonyms(path)
    assert table["好"] == ["不错", "棒", "赞"]  # a word in two groups gets both
    assert table["不错"] == ["好", "棒"]
    assert table["实惠"] == ["便宜"]
    assert "#" not in table and "a" not in table


@pytest.mark.parametrize(
    "content, line, what",
    [
        ("好 棒\n".encode("utf-8") + "便宜 实惠\n".encode("gbk"), 2, "UTF-8"),
        ("好 棒\n\n孤单\n".encode("utf-8"), 3, "two words"),
    ],
)
def test_bad_synonym_file_names_file_and_line(tmp_path, content, line, what):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=what) as err:
        load_synonyms(path)
    assert str(path) in str(err.value) and f"line {line}" in str(err.value)


def test_missing_synonym_file_names_it(tmp_path):
    with pytest.raises(ValueError, match="nope.txt"):
        load_synonyms(tmp_path / "nope.txt")


def test_builtin_table_loads_and_has_no_negations():
    table = load_builtin_synonyms()
    assert load_synonyms(None) == table and load_synonyms("") == table
    assert len(table) > 300
    assert {"棒", "不错"} <= set(table["好"]) and "实惠" in table["便宜"]
    assert not NEGATIONS & set(table)
    assert all(word not in others for word, others in table.items())


def test_span_samples_are_runs_of_each_text_new_and_seeded():
    texts = [list("这本书的内容很好但是印刷太差了"), ["很", "好"], list("物流很快包装也结实")]
    spans = span_samples(texts, 6, seed=3)
    assert spans == span_samples(texts, 6, seed=3) and spans != span_samples(texts, 6, seed=4)
    joined = ["".join(t) for t in texts]
    for span in spans:
        s = "".join(span)
        # a run of consecutive tokens of a text of 3 or more tokens, never a whole text, at least two characters
        assert any(s in j for j in joined[::2]) and s not in joined and len(s) >= 2
        assert 1 <= len(span) <= 12
    assert len({tuple(s) for s in spans}) == len(spans) and len(spans) > 6  # no repeats; both texts gave some
    assert not any("".join(s) in "很好" for s in spans)  # a two-token text gives none
    lengths = [len(s) for s in spans]
    assert min(lengths) <= 5 and max(lengths) > 5  # phrases and clauses
    assert span_samples(texts, 0, seed=3) == []
    with pytest.raises(ValueError, match="n_spans"):
        span_samples(texts, -1, seed=3)
