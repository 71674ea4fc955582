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


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
