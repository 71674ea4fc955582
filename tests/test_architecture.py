"""deployments -> flows -> tasks -> training; training never imports prefect; flows never import torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 3 kept, 0 broken" in out.stdout


def test_the_workers_start_without_mlflow_prefect_or_jieba():
    """The torchrun workers import what training needs and no more: MLflow only where a rank logs (rank 0 of a tracked
    run), jieba only where text is segmented. A GPU machine's image with torch, transformers and pydantic runs them
    (`python -m bench.gpu`), and ranks other than 0 start faster."""
    code = ("import sys\n"
            "import training.worker, training.mlm\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'prefect', 'jieba', 'optuna'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
