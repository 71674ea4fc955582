"""Checkpoints written atomically and loaded only after their digest checks out.

Each ``NAME.pt`` has a sidecar ``NAME.pt.json`` with its sha256 and what it
holds (step, epoch). Writes go to a temporary file in the same folder, are
fsynced, then renamed, so a crash mid-write leaves the previous file intact.
The sidecar is written first and keeps the previous file's digest too until
the new file is in place: a crash between the renames leaves the previous
checkpoint, which still matches, so there is always one that loads. Loads use
``weights_only=True`` and only after the digest matches: a checkpoint cannot
run code.

The model weights (the ``model`` entry) are stored compressed where pruning left zeros: a tensor with enough
zeros to save space is kept as a bitmap of its non-zeros plus their values, so an 80% sparse model takes
about a quarter of the space. Loading gives back the ordinary dense state dict.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.storage import writing


class CheckpointError(RuntimeError):
    pass


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
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


PACKED = "zhflow.bitmap.v1"
MIN_SAVING = 0.02  # pack a tensor only when the bitmap + values are at least 2% smaller than the dense tensor


def pack_tensor(t: torch.Tensor) -> torch.Tensor | dict:
    """A float tensor with enough zeros as {bitmap of non-zeros, values}; anything else as it is."""
    if not t.is_floating_point() or t.numel() < 64:
        return t
    nonzero = t != 0
    kept = int(nonzero.sum())
    if t.numel() / 8 + kept * t.element_size() > (1 - MIN_SAVING) * t.numel() * t.element_size():
        return t  # the bitmap (1 bit per weight) would not save enough
    bits = np.packbits(nonzero.cpu().numpy().ravel())
    return {PACKED: True, "shape": list(t.shape), "bits": torch.from_numpy(bits), "values": t[nonzero].clone()}


def unpack_tensor(value: torch.Tensor | dict) -> torch.Tensor:
    if not isinstance(value, dict) or not value.get(PACKED):
        return value
    numel = int(np.prod(value["shape"])) if value["shape"] else 1
    values = value["values"]
    mask = torch.from_numpy(np.unpackbits(value["bits"].cpu().numpy(), count=numel).astype(bool)).to(values.device)
    dense = torch.zeros(numel, dtype=values.dtype, device=values.device)
    dense[mask] = values
    return dense.view(value["shape"])


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any], **meta: Any) -> str:
    """Write ``payload`` (tensors, numbers, strings, dicts) and its sidecar; return the sha256."""
    path = Path(path)
    if isinstance(payload.get("model"), dict):
        payload = {**payload, "model": {k: pack_tensor(v) for k, v in payload["model"].items()}}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    sidecar = path.with_name(path.name + ".json")
    entry = {"sha256": digest, "bytes": len(data), **meta}
    current = (_read_sidecar(sidecar) or {}) if path.is_file() else {}
    if current:  # the file now on disk, whole: its entry is kept until the new file is in place
        on_disk = hashlib.sha256(path.read_bytes()).hexdigest()
        for known in (current, current.get("previous") or {}):  # after a cut-short write, the "previous" one
            if known.get("sha256") == on_disk:
                entry["previous"] = {k: v for k, v in known.items() if k != "previous"}
                break
    with writing("the checkpoint", path):
        _atomic_write(sidecar, json.dumps(entry).encode())
        _atomic_write(path, data)
        if "previous" in entry:
            del entry["previous"]
            _atomic_write(sidecar, json.dumps(entry).encode())
    return digest


def _read_sidecar(sidecar: Path) -> dict | None:
    try:
        return json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    sidecar = path.with_name(path.name + ".json")
    if not path.is_file() or not sidecar.is_file():
        raise CheckpointError(f"{path}: checkpoint or its sidecar {sidecar.name} is missing")
    entry = _read_sidecar(sidecar)
    if not entry or "sha256" not in entry:
        raise CheckpointError(f"{sidecar}: not a checkpoint sidecar (unreadable JSON or no sha256)")
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    # "previous": a newer checkpoint's write was cut short between the sidecar and the file; this file is the last whole one
    if actual not in (entry["sha256"], entry.get("previous", {}).get("sha256")):
        raise CheckpointError(f"{path}: sha256 {actual[:12]}… does not match its sidecar ({entry['sha256'][:12]}…); the file is damaged")
    state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    if isinstance(state.get("model"), dict):
        state["model"] = {k: unpack_tensor(v) for k, v in state["model"].items()}
    return state
