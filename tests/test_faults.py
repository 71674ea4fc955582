"""Faults survived, with real processes: a hard kill of the whole pipeline, kills during a checkpoint write and
during model registration, a full disk or read-only folder, and servers that are unreachable or go away."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tasks.recover import OWNER_ENV, orphans, owner_gone, recover

ZHFLOW = str(Path(sys.executable).with_name("zhflow"))


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", ZHFLOW_HOME=str(tmp_path / "home"),
                PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL="")


def _marked(owner_pid: int) -> list[int]:
    """Processes whose $ZHFLOW_OWNER names ``owner_pid`` of this host."""
    from tests.test_server_mode import _marked as holding

    return holding(f"{OWNER_ENV}={socket.gethostname()}:{owner_pid}:")


def _kill_all(proc: subprocess.Popen) -> None:
    """End a zhflow process started in a session of its own, and every process it left (their groups)."""
    for pid in _marked(proc.pid):
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_process_of_a_gone_owner_is_an_orphan_and_is_ended(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    from tasks.recover import _this_owner

    host, _, _, boot, pidns = _this_owner(os.getpid()).split(":")
    dead_owner = f"{host}:{gone.pid}:1:{boot}:{pidns}"
    assert owner_gone(dead_owner) and not owner_gone(_this_owner(os.getpid()))
    for elsewhere in (f"another-host:{gone.pid}:1:{boot}:{pidns}",  # another machine,
                      f"{host}:{gone.pid}:1:{boot}:{int(pidns) + 1}",  # another container on this one,
                      f"{host}:{gone.pid}:1:0000abcd:{pidns}",  # before a reboot,
                      f"{host}:{gone.pid}:1"):  # or an owner written some other way: never ours to judge
        assert not owner_gone(elsewhere), elsewhere
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                             env=dict(os.environ, **{OWNER_ENV: dead_owner}))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                             env=dict(os.environ, **{OWNER_ENV: _this_owner(os.getpid())}))
    try:
        _wait_for(lambda: child.pid in orphans(), 10, "the orphan to show")
        assert alive.pid not in orphans()
        from tasks.recover import end_orphans

        assert child.pid in end_orphans(grace=5)
        assert child.wait(timeout=10) == -signal.SIGTERM
        assert alive.poll() is None
    finally:
        for proc in (child, alive):
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_hard_kill_of_the_pipeline_is_settled_by_the_next_run(tmp_path):
    """SIGKILL of the flow process during training: the next `zhflow run` ends its orphaned torchrun job, marks its
    MLflow runs FAILED with the reason, and runs to the end itself."""
    env = _env(tmp_path)
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen([ZHFLOW, "run", "--preset", "tiny", "--nproc", "2", "--experiment", "kill", "--set", "train.epochs=30"],
                             cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(lambda: "[train] epoch" in (tmp_path / "first.log").read_text(), 300, "training to start")
        workers = _marked(first.pid)  # torchrun, its 2 workers, and the temporary Prefect server
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in workers]
        assert len(workers) >= 4 and sum(b"torch.distributed.run" in c for c in commands) == 1, commands
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        time.sleep(1)
        assert [pid for pid in workers if Path(f"/proc/{pid}").exists()], "the workers died with their parent: nothing to find"
        second = subprocess.run([ZHFLOW, "run", "--preset", "tiny", "--experiment", "kill", "--set", "train.epochs=1",
                                 "--set", "prune.finetune_epochs=0"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=600)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert "settled what killed zhflow processes left behind" in second.stdout + second.stderr
        assert not _marked(first.pid), "processes of the killed run are still there"
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        runs = client.search_runs([client.get_experiment_by_name("kill").experiment_id])
        killed = [r for r in runs if r.data.tags["zhflow.owner"].split(":")[1] == str(first.pid)]
        left_running = [r for r in killed if r.info.status != "FINISHED"]  # the stages that had finished stay FINISHED
        assert {r.data.tags.get("zhflow.stage") for r in left_running} == {None, "train"}, [(r.info.run_name, r.info.status) for r in killed]
        assert all(r.info.status == "FAILED" and "ended without closing this run" in r.data.tags["zhflow.failure"]
                   for r in left_running)
        ids = {r.info.run_id for r in killed}
        assert {r.info.status for r in runs if r.info.run_id not in ids} == {"FINISHED"}  # the second run
        assert recover(client) == {"ended_processes": [], "failed_runs": []}  # nothing left to settle
        with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:  # the Prefect side: Crashed, not Running forever
            states = dict(db.execute("select name, state_type from flow_run").fetchall())
        assert sorted(states.values()) == ["COMPLETED", "CRASHED"], states
    finally:
        log.close()
        _kill_all(first)


@pytest.mark.slow
def test_a_sigterm_to_the_whole_group_ends_the_runs_and_the_temporary_server(tmp_path):
    """`timeout` and schedulers signal the command's whole process group. The temporary Prefect server runs in a session
    of its own, so it still answers while the flow ends its runs; zhflow then exits (143) and stops it."""
    env = _env(tmp_path)
    log = (tmp_path / "run.log").open("w")
    run = subprocess.Popen([ZHFLOW, "run", "--preset", "tiny", "--experiment", "term", "--set", "train.epochs=30",
                            "--set", "train.patience=30"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        _wait_for(lambda: "[train] epoch" in (tmp_path / "run.log").read_text(), 300, "training to start")
        assert any(b"uvicorn" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _marked(run.pid))
        os.killpg(run.pid, signal.SIGTERM)  # as `timeout` does: the group
        assert run.wait(timeout=120) == 128 + signal.SIGTERM
        out = (tmp_path / "run.log").read_text()
        assert "zhflow: terminated" in out and "ConnectError" not in out and "Error logging to API" not in out
        _wait_for(lambda: not _marked(run.pid), 15, "the server and the workers to end")
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        runs = client.search_runs([client.get_experiment_by_name("term").experiment_id])
        assert "RUNNING" not in {r.info.status for r in runs} and any(r.info.status == "FAILED" for r in runs)
    finally:
        log.close()
        _kill_all(run)


CHECKPOINT_WRITER = """
import sys, torch
from training.checkpoint import save_checkpoint
path, start = sys.argv[1], int(sys.argv[2])
for step in range(start, start + 100000):
    save_checkpoint(path, {"model": {"w": torch.full((256, 1024), float(step))}, "step": step}, step=step)
    print(step, flush=True)
"""


def test_a_kill_during_checkpoint_writes_always_leaves_one_that_loads(tmp_path):
    """SIGKILL at random moments of a loop of checkpoint writes (1 MB each), 5 times: every time, the checkpoint on disk loads,
    is the last one written whole (or the one being written, if its rename was done), and no temporary file piles up."""
    import random

    from training.checkpoint import load_checkpoint

    path, rng, last = tmp_path / "last.pt", random.Random(7), -1
    for round_ in range(5):
        writer = subprocess.Popen([sys.executable, "-c", CHECKPOINT_WRITER, str(path), str(last + 1)],
                                  stdout=subprocess.PIPE, text=True)
        first = writer.stdout.readline()  # at least one write done in this round
        assert first.strip(), "the writer died before writing"
        time.sleep(rng.uniform(0.0, 0.4))
        writer.kill()
        printed = [int(first)] + [int(line) for line in writer.stdout.read().split()]
        writer.wait()
        state = load_checkpoint(path)
        assert state["step"] in (printed[-1], printed[-1] + 1), (round_, state["step"], printed[-1])
        assert torch.equal(state["model"]["w"], torch.full((256, 1024), float(state["step"])))
        last = state["step"]
    assert len(list(tmp_path.glob(".*.tmp"))) <= 2  # at most the last killed write's temporaries


def test_a_cut_between_the_sidecar_and_the_file_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from training import checkpoint

    path = tmp_path / "best.pt"
    checkpoint.save_checkpoint(path, {"model": {"w": torch.zeros(4)}, "step": 1}, step=1)
    real = checkpoint._atomic_write

    def cut(target, data):
        if target == path:
            raise KeyboardInterrupt  # the process dies after the sidecar, before the checkpoint's rename
        real(target, data)

    monkeypatch.setattr(checkpoint, "_atomic_write", cut)
    for step in (2, 3):  # cut short twice in a row (a restarted worker killed again at the same point)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_checkpoint(path, {"model": {"w": torch.ones(4)}, "step": step}, step=step)
        assert checkpoint.load_checkpoint(path)["step"] == 1
    monkeypatch.setattr(checkpoint, "_atomic_write", real)
    assert "previous" in json.loads((tmp_path / "best.pt.json").read_text())
    checkpoint.save_checkpoint(path, {"model": {"w": torch.ones(4)}, "step": 4}, step=4)
    assert checkpoint.load_checkpoint(path)["step"] == 4
    assert "previous" not in json.loads((tmp_path / "best.pt.json").read_text())  # only while a write is under way
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # damaged: matches neither digest
    with pytest.raises(checkpoint.CheckpointError, match="does not match its sidecar"):
        checkpoint.load_checkpoint(path)


REGISTRAR = """
import os, sys, mlflow
from mlflow.tracking import MlflowClient
from tasks.register import F1_TAG, SPLIT_TAG, _move_alias_locked, registry_lock
uri, start = sys.argv[1], int(sys.argv[2])
client = MlflowClient()
for i in range(start, start + 100000):
    with registry_lock("killed"):
        version = mlflow.register_model(uri, "killed", tags={F1_TAG: str(i / 1e6), SPLIT_TAG: "same"}).version
        _move_alias_locked(client, "killed", str(version), i / 1e6, "same", None)
    print(version, flush=True)
"""


@pytest.mark.slow
def test_a_kill_during_registration_never_leaves_an_alias_on_a_version_that_is_not_ready(tmp_path, mlflow_store):
    """SIGKILL at random moments of a loop of registrations + alias moves (the register task's own steps, under its
    lock): every alias points at a READY version, and the next registration goes through (no lock is left held)."""
    import random

    import mlflow

    code = tmp_path / "echo_model.py"
    code.write_text("import mlflow\n\nclass Echo(mlflow.pyfunc.PythonModel):\n    def predict(self, context, model_input: list[str]) -> list[str]:\n"
                    "        return model_input\n\nmlflow.models.set_model(Echo())\n")
    with mlflow.start_run():
        uri = mlflow.pyfunc.log_model(name="model", python_model=str(code)).model_uri
    rng, env = random.Random(11), dict(os.environ)
    client, start = MlflowClient(), 0
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", REGISTRAR, uri, str(start)], stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout.readline().strip(), "the registrar died before registering"  # the lock was free again
        time.sleep(rng.uniform(0.0, 1.5))
        proc.kill()
        proc.wait()
        versions = client.search_model_versions("name = 'killed'")
        model = client.get_registered_model("killed")
        assert model.aliases, "no alias at all"
        for alias, version in model.aliases.items():  # a version whose registration (tags included) completed
            found = client.get_model_version("killed", version)
            assert found.status == "READY" and "test_macro_f1" in found.tags, (round_, alias, version)
        start = len(versions) * 10
    assert client.get_model_version_by_alias("killed", "champion").status == "READY"


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (a disk that fills up; remounted read-only on request), or, where mounting is not allowed,
    a folder with a 1 MiB file size limit in this process (RLIMIT_FSIZE: a write past it fails with EFBIG)."""
    import resource

    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode == 0
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if not mounted:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))

    def read_only():
        if not mounted:
            pytest.skip("no tmpfs mount here (not root, or no CAP_SYS_ADMIN): a read-only folder cannot be made for root")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)

    try:
        yield mount, read_only
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
        if mounted:
            subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_while_writing_a_checkpoint_is_a_clear_error_and_the_previous_one_loads(small_disk):
    from training.checkpoint import load_checkpoint, save_checkpoint
    from training.storage import StorageError

    disk, _ = small_disk
    path = disk / "run" / "last.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(1000)}, "step": 1}, step=1)
    with pytest.raises(StorageError, match=r"could not write the checkpoint to .*disk.*(disk is full|size limit)"):
        save_checkpoint(path, {"model": {"w": torch.ones(400_000)}, "step": 2}, step=2)  # 1.6 MB: does not fit
    assert load_checkpoint(path)["step"] == 1
    assert not list(path.parent.glob(".*.tmp"))  # the partial file is gone


def _prepare(disk: Path, rows: int):
    from tests.conftest import sentiment_rows, write_csv
    from training.overrides import apply_overrides
    from training.presets import tiny
    from training.data.prepare import prepare_dataset

    data = write_csv(disk.parent / f"reviews-{rows}.csv", sentiment_rows(rows))
    config = apply_overrides(tiny(), [f"data.dataset={data}", "data.max_samples=null"])
    out = disk / "prepared" / f"r{rows}"
    return out, lambda: prepare_dataset(config.data, config.preprocess, out)


def test_a_full_disk_while_preparing_data_is_a_clear_error_and_the_cached_result_stays(small_disk):
    from training.data.prepare import load_manifest
    from training.storage import StorageError

    disk, _ = small_disk
    cached, prepare_small = _prepare(disk, 30)
    manifest = prepare_small()
    before = {p.name: p.read_bytes() for p in cached.iterdir()}
    big, prepare_big = _prepare(disk, 8000)  # about 2 MB of arrays and JSON lines: more than the disk holds
    with pytest.raises(StorageError, match=r"could not write the prepared dataset to .*(disk is full|size limit)"):
        prepare_big()
    assert not big.exists() and not list(big.parent.glob("*.tmp-*"))  # nothing half-written left
    assert {p.name: p.read_bytes() for p in cached.iterdir()} == before
    assert load_manifest(cached) == manifest


def test_a_read_only_folder_is_a_clear_error_and_the_cached_result_stays(small_disk):
    from training.checkpoint import load_checkpoint, save_checkpoint
    from training.storage import StorageError

    disk, read_only = small_disk
    cached, prepare_small = _prepare(disk, 30)
    prepare_small()
    path = disk / "last.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(10)}, "step": 1}, step=1)
    read_only()
    with pytest.raises(StorageError, match="could not write the checkpoint to .*: the file system is read-only"):
        save_checkpoint(path, {"model": {"w": torch.ones(10)}, "step": 2}, step=2)
    assert load_checkpoint(path)["step"] == 1
    other, prepare_other = _prepare(disk, 31)
    with pytest.raises(StorageError, match="could not write the prepared dataset to .*: the file system is read-only"):
        prepare_other()
    assert (cached / "manifest.json").is_file() and not other.exists()


@pytest.mark.parametrize("setting, value, named", [
    ("MLFLOW_TRACKING_URI", "http://127.0.0.1:{port}", "the MLflow tracking server at http://127.0.0.1:{port}/health (MLFLOW_TRACKING_URI)"),
    ("PREFECT_API_URL", "http://127.0.0.1:{port}/api", "the Prefect server at http://127.0.0.1:{port}/api/health (PREFECT_API_URL)"),
], ids=["mlflow", "prefect"])
@pytest.mark.parametrize("server", ["closed port", "accepts and never answers"])
def test_an_unreachable_server_at_start_is_a_clear_error_in_bounded_time(tmp_path, monkeypatch, capsys, setting, value,
                                                                         named, server):
    from flows.cli import main
    from tasks import servers

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if server == "accepts and never answers":
        listener.listen(8)
    else:
        listener.close()
    monkeypatch.setattr(servers, "CHECK_SECONDS", 3.0)
    monkeypatch.setenv(setting, value.format(port=port))
    monkeypatch.setenv("ZHFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    import tasks.tracking  # noqa: F401  loaded before the clock starts: the bound is on the check, not on imports

    started = time.monotonic()
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["run", "--preset", "tiny"])
    finally:
        listener.close()
    assert exit_.value.code == 2 and time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert named.format(port=port) in err and "did not answer within 3 s" in err, err
    assert not (tmp_path / "home").exists() and not (tmp_path / "mlflow.db").exists()  # nothing recorded, nothing started


def _server_goes_away(tmp_path: Path, which: str) -> tuple[subprocess.CompletedProcess, float, str]:
    """`zhflow run` with a real ``which`` server (SQLite behind it) that is killed while the run trains; returns the
    finished run, the seconds from the kill to its exit, and the server's address."""
    from deployments.server import Servers
    from tests.test_server_mode import _free_port, _wait_http, processes

    marker = f"ZHFLOW_FAULT_TEST={tmp_path.name}"
    servers = Servers(prefect_port=_free_port(), mlflow_port=_free_port(), mlflow_db=f"sqlite:///{tmp_path / 'server.db'}",
                      artifacts=str(tmp_path / "artifacts"), logs=tmp_path / "logs")
    cmd, env = servers.commands()[which]
    env = dict(env, ZHFLOW_FAULT_TEST=tmp_path.name, PREFECT_HOME=str(tmp_path / "prefect-server"))
    run_env = dict(_env(tmp_path), ZHFLOW_FAULT_TEST=tmp_path.name,
                   MLFLOW_HTTP_REQUEST_MAX_RETRIES="1", PREFECT_CLIENT_MAX_RETRIES="1")  # retries shortened: see the README
    address = servers.mlflow_uri if which == "mlflow" else servers.prefect_api
    run_env["MLFLOW_TRACKING_URI" if which == "mlflow" else "PREFECT_API_URL"] = address
    with processes(marker) as start:
        server_log = tmp_path / f"{which}.log"
        server = start(cmd, env=env, stdout=server_log.open("wb"), stderr=subprocess.STDOUT)
        _wait_http(servers.health_url(which), server, server_log)
        run_log = tmp_path / "run.log"
        run = start([ZHFLOW, "run", "--preset", "tiny", "--set", "train.epochs=30"], cwd=tmp_path, env=run_env,
                    stdout=run_log.open("w"), stderr=subprocess.STDOUT)
        _wait_for(lambda: "[train] epoch" in run_log.read_text() or run.poll() is not None, 300, "training to start")
        assert run.poll() is None, run_log.read_text()[-3000:]
        os.killpg(server.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            run.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run hangs 300 s after its {which} server went away:\n{run_log.read_text()[-3000:]}")
        seconds = time.monotonic() - killed
        time.sleep(2)
        assert not [pid for pid in _marked(run.pid)], "the run left processes behind"
    return subprocess.CompletedProcess(run.args, run.returncode, run_log.read_text()), seconds, address.removesuffix("/api")


@pytest.mark.slow
@pytest.mark.parametrize("which, named", [("mlflow", "the MLflow tracking server at {address} stopped answering"),
                                          ("prefect", "the Prefect server at {address}/api stopped answering")])
def test_a_server_that_goes_away_mid_run_ends_it_with_a_clear_error_in_bounded_time(tmp_path, which, named):
    run, seconds, address = _server_goes_away(tmp_path, which)
    assert run.returncode == 1, run.stdout[-3000:]
    assert named.format(address=address) in run.stdout.splitlines()[-1] or named.format(address=address) in run.stdout, run.stdout[-2000:]
    assert seconds < 180, f"{seconds:.0f} s from the kill to the end of the run"
