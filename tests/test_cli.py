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


def test_help_lists_the_options():
    out = subprocess.run([ZHFLOW, "run", "--help"], capture_output=True, text=True, timeout=60)
    for option in ("--dataset", "--preset", "--model", "--nproc", "--experiment", "--set", "--json-out"):
        assert option in out.stdout
