"""Parallel writers: 8 OS processes log metrics at once, for half a minute, through ``training.metric_logger`` (as the
training worker does: ``MetricLogger(run_id)`` with MLFLOW_TRACKING_URI set, ``add`` per step, ``flush`` per epoch)
to the embedded SQLite store zhflow uses by default, and 8 more at the same time to an ``mlflow server`` on a fresh
PostgreSQL database, started as ``zhflow server`` starts it. Afterwards every (run, key, step) must be in the store
exactly once with its value, every writer must have exited cleanly and every run must be FINISHED.

Per store: six writers with a run each (they end their own run, while the others still write) and two writers
sharing one run (same keys, even and odd steps; the test ends that run, as a flow ends a stage's run). Values are a
function of (writer, key, step), so lost, duplicated or mixed-up points all show. Everything started is stopped and
the database dropped, even on failure.

The writer itself is this module run as a program: ``python -m tests.test_parallel_writers '<json spec>'``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.test_server_mode import _free_port, _marked, _wait_http, pg_urls, processes  # noqa: F401 (pg_urls: fixture)

DURATION_S = 30  # how long the writers log, all at once
WRITERS = 8  # per store
SHARED = 2  # of which the last SHARED share one run
KEYS = [f"m{k}" for k in range(5)]
STEPS_PER_EPOCH = 32  # 160 points per flush
PAUSE_S = 0.2  # between flushes: the rest of an epoch
REPO = Path(__file__).resolve().parent.parent


def value(writer: int, key: int, step: int) -> float:
    """What writer ``writer`` logs for ``KEYS[key]`` at ``step``: exact in a double, distinct per writer and key."""
    return (writer + 1) * 1000 + key * 100 + step / 1024


def steps(slot: int, stride: int, epochs: int) -> range:
    """The steps a writer logs in ``epochs`` epochs: all of them alone in its run, every ``stride``-th in a shared run."""
    return range(slot, epochs * STEPS_PER_EPOCH * stride, stride)


def write(spec: dict) -> None:
    """One writer process: wait for the start signal, log epochs until the deadline, report, end its run if it owns it."""
    os.environ["MLFLOW_TRACKING_URI"] = spec["tracking_uri"]
    from mlflow.tracking import MlflowClient

    from training.metric_logger import MetricLogger

    log = MetricLogger(spec["run_id"])  # as training/worker.py builds it
    Path(spec["ready"]).touch()
    go = Path(spec["go"])
    while not go.exists():
        time.sleep(0.05)
    deadline = float(go.read_text())
    epochs, stride, slot, slowest = 0, spec["stride"], spec["slot"], 0.0
    first = time.time()
    while time.time() < deadline:
        for i in range(STEPS_PER_EPOCH):
            step = (epochs * STEPS_PER_EPOCH + i) * stride + slot
            log.add(step, **{key: value(spec["writer"], k, step) for k, key in enumerate(KEYS)})
        flushing = time.monotonic()
        log.flush()
        slowest = max(slowest, time.monotonic() - flushing)
        epochs += 1
        time.sleep(PAUSE_S)
    Path(spec["result"]).write_text(json.dumps({"epochs": epochs, "first": first, "last": time.time(),
                                               "slowest_flush": slowest}))
    if spec["end_run"]:
        MlflowClient().set_terminated(spec["run_id"], "FINISHED")


def _create_runs(uri: str, experiment: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment(experiment)
    return [client.create_run(experiment_id, run_name=f"writers-{i}").info.run_id for i in range(WRITERS - SHARED + 1)]


def _specs(store: str, uri: str, run_ids: list[str], work: Path) -> list[dict]:
    specs = []
    for writer in range(WRITERS):
        shared = writer >= WRITERS - SHARED
        name = f"{store}-{writer}"
        specs.append({"store": store, "tracking_uri": uri, "writer": writer, "name": name,
                      "run_id": run_ids[WRITERS - SHARED] if shared else run_ids[writer],
                      "stride": SHARED if shared else 1, "slot": writer - (WRITERS - SHARED) if shared else 0,
                      "end_run": not shared, "ready": str(work / f"{name}.ready"), "go": str(work / "go"),
                      "result": str(work / f"{name}.json")})
    return specs


def _problems(uri: str, specs: list[dict]) -> tuple[list[str], int]:
    """What is wrong in the store at ``uri`` after ``specs`` ran; and how many points were checked."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    problems, checked = [], 0
    for run_id in dict.fromkeys(spec["run_id"] for spec in specs):
        writers = [spec for spec in specs if spec["run_id"] == run_id]
        status = client.get_run(run_id).info.status
        if status != "FINISHED":
            problems.append(f"run {run_id}: {status}")
        for k, key in enumerate(KEYS):
            expected = {}
            for spec in writers:
                epochs = json.loads(Path(spec["result"]).read_text())["epochs"]
                expected |= {step: value(spec["writer"], k, step) for step in steps(spec["slot"], spec["stride"], epochs)}
            history = client.get_metric_history(run_id, key)
            counts = Counter(m.step for m in history)
            missing = sorted(expected.keys() - counts.keys())
            extra = sorted(counts.keys() - expected.keys())
            twice = sorted(step for step, n in counts.items() if n > 1)
            wrong = sorted({m.step for m in history if m.step in expected and m.value != expected[m.step]})
            checked += len(expected)
            for what, found in (("missing", missing), ("unexpected", extra), ("duplicated", twice), ("wrong value", wrong)):
                if found:
                    problems.append(f"run {run_id} key {key}: {len(found)} steps {what}, e.g. {found[:5]}")
    return problems, checked


@pytest.mark.slow
def test_parallel_writers_sqlite_and_postgres(tmp_path, pg_urls):
    """Both stores in the same minute: 2 x 8 writer processes, a tracking server and PostgreSQL on one machine."""
    from deployments.server import Servers, ensure_database

    sqlite_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    port = _free_port()
    servers = Servers(mlflow_port=port, mlflow_db=pg_urls["mlflow"], artifacts=str(tmp_path / "artifacts"),
                      logs=tmp_path / "logs")
    servers.logs.mkdir()
    marker = f"zhflow-it-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "ZHFLOW_", "PYTEST_"))}
    env |= {"ZHFLOW_TEST_MARKER": marker, "PYTHONPATH": str(REPO)}
    work = tmp_path / "writers"
    work.mkdir()
    t0 = time.monotonic()
    with processes(marker) as start:
        writers = {}

        def start_writers(specs: list[dict]) -> None:
            for spec in specs:
                with open(work / f"{spec['name']}.log", "wb") as out:
                    writers[spec["name"]] = start([sys.executable, "-m", "tests.test_parallel_writers", json.dumps(spec)],
                                                  cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

        ensure_database(pg_urls["mlflow"])
        server_cmd, _ = servers.commands()["mlflow"]
        server_log = servers.logs / "mlflow.log"
        with open(server_log, "wb") as out:
            server = start(server_cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        # the SQLite writers start (and wait) while the server starts: both take tens of seconds here
        specs = _specs("sqlite", sqlite_uri, _create_runs(sqlite_uri, "parallel-writers"), work)
        start_writers(specs)
        _wait_http(servers.health_url("mlflow"), server, server_log)
        t_server = time.monotonic() - t0
        specs += _specs("postgres", servers.mlflow_uri, _create_runs(servers.mlflow_uri, "parallel-writers"), work)
        start_writers(specs[WRITERS:])

        def logs(names) -> str:
            return "\n".join(f"--- {name}:\n{(work / f'{name}.log').read_text()[-2000:]}" for name in names)

        deadline = time.monotonic() + 300  # 16 interpreters importing MLflow on a small machine
        while not all(Path(spec["ready"]).exists() for spec in specs):
            dead = [name for name, proc in writers.items() if proc.poll() is not None]
            assert not dead, f"writers exited before the start:\n{logs(dead)}"
            assert time.monotonic() < deadline, "writers not ready in 300 s"
            time.sleep(0.2)
        t_ready = time.monotonic() - t0
        began = time.time()
        (work / "go.tmp").write_text(str(began + DURATION_S))
        (work / "go.tmp").rename(work / "go")  # whole or not at all: a writer polling for it never reads it half-written

        for name, proc in writers.items():
            try:
                proc.wait(timeout=max(1.0, began + DURATION_S + 180 - time.time()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"writer {name} still running 180 s after the deadline:\n{logs([name])}")
        failed = [name for name, proc in writers.items() if proc.returncode != 0]
        assert not failed, f"writers failed:\n{logs(failed)}"
        ended = time.time()

        from mlflow.tracking import MlflowClient

        for uri, store in ((sqlite_uri, "sqlite"), (servers.mlflow_uri, "postgres")):
            shared = next(spec for spec in specs if spec["store"] == store and not spec["end_run"])
            MlflowClient(tracking_uri=uri).set_terminated(shared["run_id"], "FINISHED")
        report = {}
        for uri, store in ((sqlite_uri, "sqlite"), (servers.mlflow_uri, "postgres")):
            mine = [spec for spec in specs if spec["store"] == store]
            results = [json.loads(Path(spec["result"]).read_text()) for spec in mine]
            # they really wrote at the same time, for the whole minute
            assert max(r["first"] for r in results) < min(r["last"] for r in results)
            assert all(r["last"] >= began + DURATION_S for r in results)
            assert all(r["epochs"] >= 3 for r in results), results
            problems, checked = _problems(uri, mine)
            assert not problems, f"{store}:\n" + "\n".join(problems[:20])
            report[store] = {"points": checked, "flushes": sum(r["epochs"] for r in results),
                             "slowest flush s": round(max(r["slowest_flush"] for r in results), 1)}
        assert server.poll() is None, server_log.read_text()[-3000:]
        print(f"\nserver up after {t_server:.0f} s, writers ready after {t_ready:.0f} s; "
              f"writers logged for {ended - began:.0f} s; {report}; "
              f"verified in {time.time() - ended:.0f} s")
    deadline = time.monotonic() + 15
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in _marked(marker)}
    assert not left, left  # nothing left running


if __name__ == "__main__":
    write(json.loads(sys.argv[1]))
