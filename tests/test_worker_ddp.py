"""The worker under real torchrun on CPU (gloo): families, restarts, several nodes, parallel runs."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from training.checkpoint import load_checkpoint
from training.distributed import torchrun_env
from training.job import WorkerJob
from training.presets import preset, tiny
from training.data.prepare import prepare_dataset
from training.events import EVENTS_FILE, EventReader, read_result

pytestmark = pytest.mark.slow


@pytest.fixture
def prepared(tmp_path, small_csv):
    cfg = tiny()
    data = cfg.data.model_copy(update={"dataset": str(small_csv), "max_samples": None})
    prepare_dataset(data, cfg.preprocess, tmp_path / "prepared")
    return tmp_path / "prepared"


def _job(tmp_path, prepared, name="out", family="textcnn", run_id=None, **train) -> WorkerJob:
    cfg = preset("tiny", family)
    train = {"epochs": 3, "patience": 3, "log_every": 1, "batch_size": 8, **train}
    return WorkerJob(stage="train", prepared_dir=str(prepared), out_dir=str(tmp_path / name), model=cfg.model,
                     train=cfg.train.model_copy(update=train), max_len=cfg.preprocess.max_len, mlflow_run_id=run_id)


def _cmd(job: WorkerJob, tmp_path, nproc=2, extra=("--standalone",)) -> list[str]:
    job_file = tmp_path / f"{os.path.basename(job.out_dir)}.json"
    job_file.write_text(job.model_dump_json())
    return [sys.executable, "-m", "torch.distributed.run", *extra, "--nproc-per-node", str(nproc),
            "--max-restarts", str(job.train.max_restarts), "-m", "training.worker", "--config", str(job_file)]


def _env(nnodes: int = 1, **extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", **torchrun_env(nnodes), **extra)  # torchrun as the launcher starts it


def _start(cmd, env) -> subprocess.Popen:
    # a session of its own: a timed-out test kills torchrun *and* its workers
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _wait(procs: list[subprocess.Popen], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Every process's output; past the deadline all are killed and the failure shows what each printed."""
    outputs: dict[int, tuple[str, str]] = {}
    readers = [threading.Thread(target=lambda i, p: outputs.__setitem__(i, p.communicate()), args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout
    for r in readers:
        r.join(max(0.0, deadline - time.monotonic()))
    late = [p for p in procs if p.poll() is None]
    # SIGTERM first: torchrun's workers run in sessions of their own, and only the agent can end them
    for sig, grace in ((signal.SIGTERM, 40), (signal.SIGKILL, 5)):
        for p in late:
            if p.poll() is None:
                os.killpg(p.pid, sig)
        for r in readers:
            r.join(grace if late else None)
    if late:
        tails = [f"--- {' '.join(p.args[3:9])} ---\n" + "".join(o[-2000:] for o in outputs[i]) for i, p in enumerate(procs)]
        pytest.fail(f"still running after {timeout} s:\n" + "\n".join(tails))
    return [subprocess.CompletedProcess(p.args, p.returncode, *outputs[i]) for i, p in enumerate(procs)]


def _run(cmd, env, timeout: int = 300) -> subprocess.CompletedProcess:
    return _wait([_start(cmd, env)], timeout)[0]


def _no_duplicate_steps(client, run_id, key):
    steps = [m.step for m in client.get_metric_history(run_id, key)]
    assert steps and len(steps) == len(set(steps)), f"{key}: {steps}"
    return steps


@pytest.mark.parametrize("family, inputs", [("fasttext", "both"), ("bilstm", "word"), ("transformer", "both")])  # textcnn: tiny, below
def test_two_process_ddp_run_per_family(tmp_path, prepared, mlflow_store, family, inputs):
    client = MlflowClient()
    run = client.create_run(client.create_experiment(f"ddp-{family}"))
    job = _job(tmp_path, prepared, family=family, run_id=run.info.run_id)
    job = job.model_copy(update={"model": job.model.model_copy(update={"input": inputs})})
    out = _run(_cmd(job, tmp_path), _env(MLFLOW_TRACKING_URI=mlflow_store, MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="0.2",
                                        MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING="1"))  # short runs get samples too
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 process(es) on cpu" in out.stdout
    # rank 0 records MLflow's system metrics into the run, once a sample (rank 1 would repeat every step)
    _no_duplicate_steps(client, run.info.run_id, "system/cpu_utilization_percentage")
    assert "system/system_memory_usage_megabytes" in client.get_run(run.info.run_id).data.metrics

    result = read_result(tmp_path / "out")
    assert result["world_size"] == 2 and result["epochs_run"] == 3
    state = load_checkpoint(result["best_checkpoint"])
    assert state["epoch"] == result["best_epoch"] and state["model_config"]["name"] == family

    assert _no_duplicate_steps(client, run.info.run_id, "val_macro_f1") == [1, 2, 3]  # only rank 0 logged
    # the events the launcher acts on: rank 0's only, progress within each epoch, one per epoch, the result last
    events = EventReader(tmp_path / "out" / EVENTS_FILE).read()
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1, 2, 3] and events[-1]["event"] == "result"
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all(0 < e["fraction"] <= 1 and e["epochs"] == 3 for e in progress)
    assert "ZHFLOW_EPOCH" not in out.stdout  # nothing machine-readable is mixed into the output for people
    _no_duplicate_steps(client, run.info.run_id, "train_loss")
    metrics = client.get_run(run.info.run_id).data.metrics
    assert metrics["samples_per_second"] > 0 and metrics["best_val_macro_f1"] == pytest.approx(result["best_val_macro_f1"])


def test_killed_rank_restarts_and_resumes_without_duplicate_metrics(tmp_path, prepared, mlflow_store):
    client = MlflowClient()
    run = client.create_run(client.create_experiment("restart"))
    job = _job(tmp_path, prepared, run_id=run.info.run_id, max_restarts=1)  # 3 optimiser steps per epoch
    env = _env(MLFLOW_TRACKING_URI=mlflow_store, ZHFLOW_TEST_KILL_AT_STEP="5", ZHFLOW_TEST_KILL_ONCE_FILE=str(tmp_path / "killed"))
    out = _run(_cmd(job, tmp_path), env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "killed").exists()  # rank 1 really died mid-epoch 2
    assert "resumed from" in out.stdout and "after epoch 1 (restart 1)" in out.stdout
    result = read_result(tmp_path / "out")
    assert result["restarts"] == 1 and result["epochs_run"] == 3
    assert _no_duplicate_steps(client, run.info.run_id, "val_macro_f1") == [1, 2, 3]
    assert _no_duplicate_steps(client, run.info.run_id, "train_loss") == list(range(1, 10))
    assert client.get_run(run.info.run_id).data.tags["restarts"] == "1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_meet_at_a_c10d_rendezvous_and_a_node_restart_resumes_both(tmp_path, prepared):
    # node 1's worker (global rank 1) dies once in epoch 2: its agent restarts it, node 0's agent sees it come back
    # to the rendezvous and restarts its own; both resume from epoch 1's checkpoint in a new round
    job = _job(tmp_path, prepared, epochs=2, max_restarts=2)
    endpoint = f"127.0.0.1:{_free_port()}"
    env = _env(nnodes=2, ZHFLOW_TEST_KILL_AT_STEP="4", ZHFLOW_TEST_KILL_ONCE_FILE=str(tmp_path / "killed"))
    procs = []
    for node in (0, 1):
        extra = ("--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-id", "two-nodes-test")
        procs.append(_start(_cmd(job, tmp_path, nproc=1, extra=extra), env))
    outputs = _wait(procs, timeout=150)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o.stdout[-2000:] + o.stderr[-2000:] for o in outputs)
    assert (tmp_path / "killed").exists()
    result = read_result(tmp_path / "out")
    assert result["world_size"] == 2 and result["epochs_run"] == 2 and result["restarts"] >= 1


def test_two_runs_at_once_do_not_collide(tmp_path, prepared):
    procs = [_start(_cmd(_job(tmp_path, prepared, name=f"run{i}", epochs=2), tmp_path), _env()) for i in (0, 1)]
    outputs = _wait(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o.stdout[-2000:] + o.stderr[-2000:] for o in outputs)
    for i in (0, 1):
        assert read_result(tmp_path / f"run{i}")["world_size"] == 2


def test_worker_error_reaches_the_caller(tmp_path, prepared):
    job = _job(tmp_path, prepared).model_copy(update={"prepared_dir": str(tmp_path / "missing")})
    out = _run(_cmd(job, tmp_path), _env())
    assert out.returncode != 0
    assert "no manifest" in out.stdout + out.stderr


def test_a_distilled_student_trains_on_the_teachers_probabilities_and_resumes_after_a_killed_rank(tmp_path, prepared):
    import numpy as np

    labels = np.load(prepared / "train.labels.npy")
    teacher = np.eye(int(labels.max()) + 1, dtype=np.float32)[labels] * 0.8 + 0.1  # a sure teacher that agrees with the labels
    np.save(tmp_path / "teacher.npy", teacher)
    # the default preset's student: fastText, whose sparse tables' optimiser state (SparseAdam) resumes too, with
    # train.l2's penalty on every row (the state's mask of active rows through the checkpoint)
    job = _job(tmp_path, prepared, family="fasttext", epochs=3, max_restarts=1).model_copy(
        update={"teacher_probs": str(tmp_path / "teacher.npy"), "temperature": 2.0, "alpha": 0.9})
    job = job.model_copy(update={"train": job.train.model_copy(update={"l2": 0.5})})
    env = _env(ZHFLOW_TEST_KILL_AT_STEP="5", ZHFLOW_TEST_KILL_ONCE_FILE=str(tmp_path / "killed"))
    out = _run(_cmd(job, tmp_path), env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "killed").exists() and "resumed from" in out.stdout
    result = read_result(tmp_path / "out")
    assert result["restarts"] == 1 and result["epochs_run"] == 3
    # a teacher with other rows than the split: one clear error from the worker
    np.save(tmp_path / "short.npy", teacher[:-1])
    bad = job.model_copy(update={"teacher_probs": str(tmp_path / "short.npy"), "out_dir": str(tmp_path / "bad"),
                                 "train": job.train.model_copy(update={"max_restarts": 0})})
    failed = _run(_cmd(bad, tmp_path), _env())
    assert failed.returncode != 0 and "the train split has" in failed.stdout + failed.stderr


def _average_tables(rank: int, world: int, store: str, out: str) -> None:
    """One rank: table gradients of its own, sparse and dense (repeated rows, a padding row, a table this rank did not
    touch, a table no rank touched), averaged."""
    import torch
    import torch.distributed as dist

    from training.distributed import average_table_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tables = [torch.nn.Embedding(50, 4, sparse=True), torch.nn.Embedding(7, 3, sparse=True),
                  torch.nn.Embedding(9, 2, sparse=True), torch.nn.Embedding(40, 3, padding_idx=0),
                  torch.nn.Embedding(6, 2)]
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 50, (30,), generator=g)  # repeats: an uncoalesced gradient
        loss = (tables[0](ids) * torch.randn(30, 4, generator=g)).sum()
        words = torch.cat([torch.zeros(5, dtype=torch.long), torch.randint(0, 40, (20,), generator=g)])  # 0: padding
        loss = loss + (tables[3](words) * torch.randn(25, 3, generator=g)).sum()
        if rank == 0:  # table 1: rank 0 only; table 2: no rank
            loss = loss + tables[1](torch.tensor([2, 2, 5])).sum() * 3
        else:  # table 4 (dense): rank 1 only, so rank 0 holds no gradient for it
            loss = loss + tables[4](torch.tensor([1, 4, 4])).sum() * 2
        loss.backward()
        before = [t.weight.grad.to_dense().clone() if t.weight.grad is not None else torch.zeros_like(t.weight) for t in tables]
        average_table_gradients(tables, world)
        after = [t.weight.grad for t in tables]
        torch.save({"before": before, "after": [a.to_dense() if a is not None else None for a in after],
                    "sparse": [a is None or a.is_sparse for a in after]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_table_gradients_are_averaged_over_the_ranks_in_one_collective(tmp_path):
    """The worker averages embedding tables itself, not through DDP, exchanging the rows each rank touched: every
    rank ends with the mean of the ranks' gradients (what DDP's all-reduce gives), rows one rank never touched
    included; sparse tables stay sparse and a sparse table no rank touched keeps no gradient; dense tables stay
    dense, also on a rank that did not touch the table."""
    import torch
    import torch.multiprocessing as mp

    mp.spawn(_average_tables, args=(2, str(tmp_path / "store"), str(tmp_path / "grads")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"grads.{r}", weights_only=True) for r in range(2)]
    for k in (0, 1, 3, 4):
        mean = (ranks[0]["before"][k] + ranks[1]["before"][k]) / 2
        assert mean.abs().sum() > 0
        for r in range(2):
            assert ranks[r]["sparse"][k] == (k < 3) and torch.allclose(ranks[r]["after"][k], mean, atol=1e-6)
        assert torch.equal(ranks[0]["after"][k], ranks[1]["after"][k])  # the same sum on every rank: tables stay equal
    assert ranks[0]["after"][2] is None and ranks[1]["after"][2] is None
    assert not ranks[0]["after"][3][0].any()  # the padding row: zero on both ranks, and zero after
