"""Security promises (README: Security): no pickle runs, stage outputs hold no pickles, and the installed versions are
at or above the releases that fixed the advisories the README lists."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tomllib
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
FIXED = {"torch": "2.10.0", "mlflow": "3.11.0", "prefect": "3.6.22"}  # the highest fix in the README's table, per package


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused_even_with_a_matching_digest(tmp_path):
    from training.checkpoint import load_checkpoint

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"model": {}, "step": 1, "x": _Payload(marker)}, buf)
    (tmp_path / "evil.pt").write_bytes(buf.getvalue())
    (tmp_path / "evil.pt.json").write_text(json.dumps({"sha256": hashlib.sha256(buf.getvalue()).hexdigest()}))
    with pytest.raises(Exception, match="(?i)weights.only|unsupported global|not an allowed global"):
        load_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()


def test_stage_outputs_are_json_and_arrays_never_pickles(tmp_path, small_csv):
    from training.overrides import apply_overrides
    from training.presets import tiny
    from training.data.prepare import prepare_dataset

    config = apply_overrides(tiny(), [f"data.dataset={small_csv}"])
    out = tmp_path / "prepared"
    prepare_dataset(config.data, config.preprocess, out)
    for path in out.iterdir():
        assert path.suffix in (".json", ".jsonl", ".npy"), path.name
        if path.suffix == ".npy":
            assert np.load(path, allow_pickle=False).dtype != object
        else:
            assert not path.read_bytes().startswith(b"\x80"), f"{path.name} is a pickle"
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".json":
                json.loads(text)
            else:
                [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_pickled_model_is_refused_by_zhflow(mlflow_store, capsys, monkeypatch):
    """A cloudpickled pyfunc model (what an edited MLmodel or another tool could put in the registry): `zhflow predict`
    refuses to unpickle it (MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false, set by zhflow unless the user set it)."""
    import mlflow

    from flows.cli import main

    monkeypatch.delenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", raising=False)

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input: list[str]) -> list[str]:
            return model_input

    with mlflow.start_run():
        uri = mlflow.pyfunc.log_model(name="model", python_model=Echo()).model_uri
    assert main(["predict", "--model-uri", uri, "好"]) == 2
    assert "pickle" in capsys.readouterr().err.lower()


def _minimum(requirement: str) -> Version:
    spec = Requirement(requirement).specifier
    return max(Version(s.version) for s in spec if s.operator in (">=", "~=", "=="))


def test_the_pins_and_the_installed_versions_are_at_or_above_the_advisory_fixes():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {Requirement(d).name: d for d in deps}
    readme = (ROOT / "README.md").read_text()
    for name, fixed in FIXED.items():
        assert _minimum(pins[name]) >= Version(fixed), pins[name]
        assert Version(metadata.version(name).split("+")[0]) >= Version(fixed), (name, metadata.version(name))
        assert f"| {name} (`" in readme  # the README lists the package's advisories
    for advisory in ("CVE-2025-32434", "CVE-2026-24747", "CVE-2023-1177", "CVE-2024-3573", "CVE-2026-2033", "CVE-2024-37052"):
        assert advisory in readme
