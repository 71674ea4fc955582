import subprocess
import sys
from pathlib import Path

import pytest

ZHFLOW = str(Path(sys.executable).with_name("zhflow"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "train.lrr=1"], "unknown field 'train.lrr'"),
        (["--set", "train.lr=abc"], "train.lr"),
        (["--nproc", "0"], "train.nproc"),
        (["--model", "gpt"], "model.name"),
        (["--set", "prune.amount=1.5"], "prune.amount"),
    ],
)
def test_bad_settings_fail_before_any_work(args, message, tmp_path):
    out = subprocess.run([ZHFLOW, "run", "--preset", "tiny", *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / ".zhflow").exists()  # nothing started


@pytest.mark.parametrize(
    "make_file, message",
    [
        (lambda p: None, "is neither a built-in corpus"),
        (lambda p: p.write_text("review,label\n好看,positive\n很差,negative\n", encoding="utf-8"), "no column 'text'"),
        (lambda p: p.write_text("text,label\n好看,positive\n不错,positive\n", encoding="utf-8"), "only one class"),
    ],
)
def test_bad_dataset_fails_before_prefect_or_mlflow_start(make_file, message, tmp_path):
    path = tmp_path / "data.csv"
    make_file(path)
    out = subprocess.run([ZHFLOW, "run", "--preset", "tiny", "--dataset", str(path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and message in out.stderr
    assert "Traceback" not in out.stderr and "temporary server" not in out.stderr + out.stdout
    assert not (tmp_path / "mlflow.db").exists()  # no FAILED runs left behind


def test_help_lists_the_options():
    out = subprocess.run([ZHFLOW, "run", "--help"], capture_output=True, text=True, timeout=60)
    for option in ("--dataset", "--preset", "--model", "--nproc", "--experiment", "--set", "--json-out"):
        assert option in out.stdout
