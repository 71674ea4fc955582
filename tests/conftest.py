"""Shared fixtures. Prefect runs against a temporary home and a real ephemeral
server (prefect_test_harness); MLflow against a temporary SQLite store."""

import csv
import os
import tempfile
from pathlib import Path

import pytest

# before Prefect is imported anywhere: never touch the user's ~/.prefect
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="zhflow-prefect-home-"))
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# fixtures live in pytest's temporary folders: allowed as data folders (tests/test_paths.py checks the refusals)
os.environ.setdefault("ZHFLOW_ALLOWED_PATHS", tempfile.gettempdir())

import prefect.main  # noqa: E402,F401  sets up Prefect's log handlers now, on the session's stderr, not on one test's captured stream


POSITIVE = ["这本书非常好看，值得一读", "质量很好，物流也快", "内容精彩，推荐购买", "非常满意，下次还来",
            "包装精美，孩子很喜欢", "服务周到，价格实惠", "性价比很高，好评", "故事感人，写得真好"]
NEGATIVE = ["质量太差了，很失望", "内容空洞，浪费时间", "物流太慢，包装破损", "非常糟糕，不推荐",
            "价格贵而且不好用", "客服态度差，退货麻烦", "印刷模糊，错别字多", "完全不值这个价"]


def write_csv(path: Path, rows: list[tuple[str, str]], header=("text", "label"), encoding="utf-8") -> Path:
    with open(path, "w", newline="", encoding=encoding) as f:
        writer = csv.writer(f)
        if header:
            writer.writerow(header)
        writer.writerows(rows)
    return path


def sentiment_rows(n_per_class: int = 30) -> list[tuple[str, str]]:
    """Distinct texts built from templates, so that dedupe keeps them all."""
    rows = []
    for i in range(n_per_class):
        rows.append((f"{POSITIVE[i % len(POSITIVE)]}，第{i}次购买", "positive"))
        rows.append((f"{NEGATIVE[i % len(NEGATIVE)]}，第{i}次购买", "negative"))
    return rows


@pytest.fixture(autouse=True)
def _owner_mark(monkeypatch):
    """`zhflow` marks its process environment for tasks.recover; a test calling it in-process leaves no mark behind."""
    monkeypatch.setenv("ZHFLOW_OWNER", "")


@pytest.fixture
def small_csv(tmp_path: Path) -> Path:
    return write_csv(tmp_path / "reviews.csv", sentiment_rows())


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch) -> str:
    """A fresh SQLite MLflow store; artifacts land under tmp_path too."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("ZHFLOW_HOME", str(tmp_path / "zhflow-home"))
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)
    # set_experiment is process-wide: an experiment id of this store must not follow the next test to its store
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    mlflow.tracking.fluent._active_experiment_id = None


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_api(prefect_server) -> str:
    """The session's Prefect server for `zhflow` subprocesses (as PREFECT_API_URL) whose test is not about the
    temporary server each would otherwise start (about 5 s each here; tests/test_first_run.py and tests/test_faults.py
    keep that path)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def build_tiny_bert(folder: Path, architecture: str = "bert", pad_last: bool = False, hidden: int = 32) -> Path:
    """A 2-layer encoder with a WordPiece vocabulary of the fixtures' characters, saved with ``save_pretrained``
    (no hub here): what a user's local checkpoint folder looks like. ``pad_last``: the pad token at the last id."""
    from transformers import BertConfig, BertModel, BertTokenizer, RobertaConfig, RobertaModel

    chars = sorted({ch for text in POSITIVE + NEGATIVE for ch in text} | set("第次购买0123456789,.!?"))
    specials = ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens = (specials + chars + ["[PAD]"]) if pad_last else (["[PAD]"] + specials + chars)
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = BertTokenizer(vocab=vocab, tokenize_chinese_chars=True)
    sizes = dict(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=2 * hidden, pad_token_id=vocab["[PAD]"])
    if architecture == "roberta":
        model = RobertaModel(RobertaConfig(max_position_embeddings=64 + vocab["[PAD]"] + 1, **sizes))
    else:
        model = BertModel(BertConfig(max_position_embeddings=64, **sizes))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_roberta_pad_last(tmp_path_factory) -> Path:
    """RoBERTa architecture, its pad token at the last id (not 0)."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-roberta"), architecture="roberta", pad_last=True)
