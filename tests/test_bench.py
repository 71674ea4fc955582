"""`python -m bench --smoke` (every section, smallest inputs) end to end, so the benchmark code cannot silently rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_smoke_bench_writes_every_section(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", ZHFLOW_HOME=str(tmp_path / "home"))
    run = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = out.read_text(encoding="utf-8")
    for heading in ("## Preprocessing", "## Training throughput", "## Quality and leakage", "## Pruning",
                    "## Orchestration overhead", "## Tracking cost", "## Sweeps"):
        assert heading in report
    assert "Machine:" in report and report.count("**met**") + report.count("**missed**") >= 9
    assert "TF-IDF char 1-3 grams + linear SVM" in report and "inflation" in report
