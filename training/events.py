"""The one channel back from the worker: rank 0 appends one JSON object a line to ``events.jsonl`` in the job's
folder, and the launcher follows the file. The output for people (stdout) is only for people.

    {"event": "progress", "epoch": 3, "epochs": 300, "fraction": 0.4}     part of an epoch done
    {"event": "epoch", "epoch": 3, "val_macro_f1": 0.81, ...}             an epoch's validation metrics
    {"event": "result", "best_checkpoint": "...", "stop_reason": ...}     the run's result, last

    from training.events import EventReader
    reader = EventReader(out_dir / EVENTS_FILE)
    for event in reader.read():   # the events written since the last call, whole lines only
        ...
"""

from __future__ import annotations

import json
from pathlib import Path

EVENTS_FILE = "events.jsonl"


class EventWriter:
    """Appends events; each is one ``write`` of one line, flushed, so a reader never sees half of one."""

    def __init__(self, path: str | Path):
        self._file = open(path, "a", encoding="utf-8")

    def emit(self, event: str, **data) -> None:
        self._file.write(json.dumps({"event": event, **data}, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class EventReader:
    """Follows an events file from its start; a line still being written is kept for the next call."""

    def __init__(self, path: str | Path):
        self.path, self._offset, self._partial = Path(path), 0, b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def read_result(out_dir: str | Path) -> dict | None:
    """The last ``result`` event of a job's folder, without its ``event`` key; None if there is none."""
    results = [e for e in EventReader(Path(out_dir) / EVENTS_FILE).read() if e["event"] == "result"]
    return {k: v for k, v in results[-1].items() if k != "event"} if results else None
