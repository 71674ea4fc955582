"""Checkpoints written atomically and loaded only after their digest checks out.

Each ``NAME.pt`` has a sidecar ``NAME.pt.json`` with its sha256 and what it
holds (step, epoch). Writes go to a temporary file in the same folder, are
fsynced, then renamed, so a crash mid-write leaves the previous file intact.
Loads use ``weights_only=True``: a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    pass


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any], **meta: Any) -> str:
    """Write ``payload`` (tensors, numbers, strings, dicts) and its sidecar; return the sha256."""
    path = Path(path)
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    _atomic_write(path, data)
    _atomic_write(path.with_name(path.name + ".json"), json.dumps({"sha256": digest, "bytes": len(data), **meta}).encode())
    return digest


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    sidecar = path.with_name(path.name + ".json")
    if not path.is_file() or not sidecar.is_file():
        raise CheckpointError(f"{path}: checkpoint or its sidecar {sidecar.name} is missing")
    expected = json.loads(sidecar.read_text())["sha256"]
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise CheckpointError(f"{path}: sha256 {actual[:12]}… does not match its sidecar ({expected[:12]}…); the file is damaged")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
