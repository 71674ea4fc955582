"""Server mode end to end, against real servers: ``zhflow server`` (Prefect + MLflow on this machine's PostgreSQL),
``zhflow deploy``, a process worker, a retrain triggered through the API with custom parameters as the UI does it,
then ``zhflow serve`` running a deployment without the worker. Everything started is stopped, even on failure."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from datetime import timezone
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
PG = os.environ.get("ZHFLOW_TEST_PG", "postgresql://postgres@127.0.0.1:5432")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_admin():
    import psycopg

    try:
        return psycopg.connect(f"{PG}/postgres", connect_timeout=5, autocommit=True)
    except psycopg.OperationalError as err:
        pytest.skip(f"no PostgreSQL at {PG}: {err}")


@pytest.fixture
def pg_urls():
    """Two fresh database names (zhflow server creates them); dropped afterwards."""
    tag = uuid.uuid4().hex[:8]
    names = {"prefect": f"zhflow_it_prefect_{tag}", "mlflow": f"zhflow_it_mlflow_{tag}"}
    _pg_admin().close()
    yield {k: f"{PG}/{v}" for k, v in names.items()}
    conn = _pg_admin()
    with conn.cursor() as cur:
        for name in names.values():
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    conn.close()


def _marked(marker: str) -> list[int]:
    """Processes whose environment holds ``marker``: everything the test started, and what those started in turn
    (flow-run processes, torchrun workers), wherever they were reparented."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@contextmanager
def processes(marker: str):
    started: list[subprocess.Popen] = []

    def start(cmd, **kw):
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, **kw)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(started):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in _marked(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _listening_on(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket listens on at ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} did not answer in {timeout}s:\n{log.read_text()[-3000:]}")


def _wait_final(client, flow_run_id, timeout: float, logs: list[Path]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state.is_final():
            return run
        time.sleep(3)
    raise AssertionError(f"flow run {flow_run_id} not finished in {timeout}s (state {run.state.name}):\n"
                         + "\n".join(p.read_text()[-3000:] for p in logs if p.exists()))


def test_scheduled_retrain_on_real_servers(tmp_path, pg_urls):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                FlowRunFilterDeploymentId)

    prefect_port, mlflow_port = _free_port(), _free_port()
    api, tracking = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "ZHFLOW_"))}
    marker = f"zhflow-it-{uuid.uuid4().hex}"
    env |= {"ZHFLOW_TEST_MARKER": marker, "PREFECT_HOME": str(tmp_path / "prefect-home"), "ZHFLOW_HOME": str(tmp_path / "zhflow-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    client_env = env | {"PREFECT_API_URL": api, "MLFLOW_TRACKING_URI": tracking}
    logs = tmp_path / "logs"
    logs.mkdir()
    with processes(marker) as start:
        server_log = logs / "zhflow-server.log"
        server = start([BIN / "zhflow", "server", "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port),
                        "--prefect-db", pg_urls["prefect"], "--mlflow-db", pg_urls["mlflow"],
                        "--artifacts", str(tmp_path / "artifacts"), "--logs", str(logs)],
                       cwd=tmp_path, env=env, stdout=open(server_log, "w"), stderr=subprocess.STDOUT)
        _wait_http(f"{api}/health", server, server_log)
        _wait_http(f"{tracking}/health", server, server_log)
        assert _listening_on(prefect_port) == _listening_on(mlflow_port) == {"127.0.0.1"}  # this machine only

        deployed = subprocess.run([BIN / "zhflow", "deploy", "--pool", "it-pool"], cwd=tmp_path, env=client_env,
                                  capture_output=True, text=True, timeout=300)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "created" in deployed.stdout
        worker_log = logs / "worker.log"
        worker = start([BIN / "prefect", "worker", "start", "--pool", "it-pool"], cwd=tmp_path, env=client_env,
              stdout=open(worker_log, "w"), stderr=subprocess.STDOUT)

        with SyncPrefectClient(api) as client:
            deployment = client.read_deployment_by_name("train_pipeline/nightly-retrain")
            assert deployment.work_pool_name == "it-pool"
            assert deployment.schedules[0].schedule.cron == "0 2 * * *"
            assert deployment.schedules[0].schedule.timezone == "Asia/Shanghai"
            assert deployment.job_variables["env"]["MLFLOW_TRACKING_URI"] == tracking
            assert {"nightly-retrain", "weekly-sweep", "evaluate-champion"} <= {
                d.name for d in client.read_deployments()}
            # what the UI's "Custom run" form sends: the deployment's parameters with the user's changes
            run = client.create_flow_run_from_deployment(deployment.id, parameters={
                "preset": "tiny", "experiment": "it-nightly", "config": {"train": {"epochs": 2}}})
            run = _wait_final(client, run.id, 600, [worker_log])
            assert run.state.is_completed(), f"{run.state}\n{worker_log.read_text()[-4000:]}"
            # the server's scheduler has put the coming nights on the calendar: 02:00 in Shanghai is 18:00 UTC
            deadline = time.monotonic() + 120
            while not (upcoming := [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]))) if r.auto_scheduled]):
                assert time.monotonic() < deadline, "no scheduled runs were created for nightly-retrain"
                time.sleep(3)
            assert all(r.state.is_scheduled() and r.expected_start_time.astimezone(timezone.utc).hour == 18 for r in upcoming)
            found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
            assert [a.key for a in found].count("metrics") == 1  # the run's own table; the prune stage's has its own key
            artifacts = {a.key: a for a in found}
            assert {"mlflow-run", "metrics", "prepared-dataset", "prune-metrics"} <= set(artifacts)

        mlflow = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
        experiment = mlflow.get_experiment_by_name("it-nightly")
        parents = mlflow.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{run.id}' and tags.`zhflow.kind` = 'train_pipeline'")
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        parent = parents[0]
        assert parent.data.params["train.epochs"] == "2" and parent.data.params["data.max_samples"] == "600"  # tiny + the change
        assert parent.data.tags["prefect.flow_run_url"].startswith(f"http://127.0.0.1:{prefect_port}/")
        assert parent.info.run_id in artifacts["mlflow-run"].data
        assert f"{parent.data.metrics['test_macro_f1']:.4f}" in artifacts["metrics"].data
        nested = {r.data.tags.get("zhflow.stage"): r for r in mlflow.search_runs(
            [experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
        assert {"preprocess", "train", "evaluate", "baseline", "prune", "register"} <= set(nested)
        version = mlflow.get_model_version_by_alias("zhflow-snownlp-sentiment", "champion")
        assert version.status == "READY" and version.tags["parent_run_id"] == parent.info.run_id
        # artifacts went through the MLflow server into its artifact folder
        assert "confusion_matrix.png" in {a.path for a in mlflow.list_artifacts(nested["evaluate"].info.run_id)}
        assert any((tmp_path / "artifacts").rglob("MLmodel")) and any((tmp_path / "artifacts").rglob("confusion_matrix.png"))

        # zhflow serve: the same deployments from one process, no worker
        os.killpg(worker.pid, signal.SIGKILL)  # the worker's own shutdown is not under test (it takes 30 s to give up)
        worker.wait()
        serve_log = logs / "serve.log"
        serve = start([BIN / "zhflow", "serve"], cwd=tmp_path, env=client_env, stdout=open(serve_log, "w"),
                      stderr=subprocess.STDOUT)
        with SyncPrefectClient(api) as client:
            deadline = time.monotonic() + 120
            while "being served" not in serve_log.read_text() and time.monotonic() < deadline:
                assert serve.poll() is None, serve_log.read_text()[-3000:]
                time.sleep(2)
            assert "being served" in serve_log.read_text(), serve_log.read_text()[-3000:]
            served = client.read_deployment_by_name("evaluate/evaluate-champion")
            nightly = client.read_deployment_by_name("train_pipeline/nightly-retrain")
            assert nightly.schedules and nightly.schedules[0].active
            run = client.create_flow_run_from_deployment(served.id, parameters={
                "model_uri": "models:/zhflow-snownlp-sentiment@champion", "dataset": "snownlp-sentiment", "experiment": "it-eval"})
            run = _wait_final(client, run.id, 300, [serve_log])
            assert run.state.is_completed(), f"{run.state}\n{serve_log.read_text()[-4000:]}"
        evaluations = mlflow.search_runs([mlflow.get_experiment_by_name("it-eval").experiment_id])
        assert len(evaluations) == 1 and evaluations[0].data.tags["model_version"] == version.version

        # a service manager's stop: SIGTERM ends zhflow serve, and zhflow server alone stops both servers
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0, serve_log.read_text()[-3000:]
        servers = [pid for pid in _marked(marker) if b" server " in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")]
        assert len(servers) >= 3  # zhflow server, prefect server, mlflow server (+ its uvicorn)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in servers) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in servers if Path(f"/proc/{pid}").exists() and _alive(pid)], "servers outlived zhflow server"
    deadline = time.monotonic() + 15  # SIGKILLed processes take a moment to disappear
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in _marked(marker)}
    assert not left, left  # nothing left running
