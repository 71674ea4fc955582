"""Sweeps: search spaces, a real Optuna study persisted in SQLite, trials through torchrun with early stopping,
the MLflow tree, the alias rule under concurrent registrations, and serving the champion."""

import json
import os
import threading

import optuna
import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main as zhflow
from tests.conftest import sentiment_rows, write_csv
from training.config import PipelineConfig
from training.presets import default, tiny
from training.sweep import DEFAULT_SPACE, SpaceError, apply_params, check_space, grid, load_space, suggest


@pytest.mark.parametrize("family", ["textcnn", "bilstm", "transformer", "fasttext"])
def test_each_familys_space_is_valid_keeps_the_family_and_never_caps_the_epochs(family):
    """A sweep from a family searches that family's settings: never another family, and never the maximum epochs
    (each trial trains until it stops improving; 3 to 6 epochs stopped TextCNN trials while still improving)."""
    from training.presets import preset
    from training.sweep import default_space

    base = preset("default", family)
    space = check_space(default_space(base))
    assert "model.name" not in space and "train.epochs" not in space
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        config = apply_params(base, suggest(trial, space))  # validated: a transformer's heads divide its width
        assert isinstance(config, PipelineConfig)
        assert config.model.name == family and config.train.epochs == base.train.epochs
        study.tell(trial, 0.5)
    assert check_space(DEFAULT_SPACE)  # a family without a space of its own


@pytest.mark.parametrize("space, message", [
    ({}, "expected a mapping"),
    ({"train.speed": {"choices": [1]}}, "train has no setting 'speed'"),
    ({"nope.lr": {"choices": [1]}}, "not a setting"),
    ({"train.lr": {"low": 0.1, "high": 0.01}}, "low must be a number below high"),
    ({"train.lr": {"low": 0, "high": 1, "log": True}}, "log range needs low > 0"),
    ({"train.lr": {"low": 0.1}}, "needs low and high"),
    ({"train.batch_size": {"choices": [0, 32]}}, "0 is not a valid value"),
    ({"model.name": {"choices": ["gpt"]}}, "'gpt' is not a valid value"),
    ({"model.name": {"choices": []}}, "non-empty list"),
    ({1: {"choices": [1]}}, "setting names are text"),
    ({"train.lr": {"low": 0.001, "high": 0.01, "log": True, "step": 0.001}}, "cannot go with log"),
    ({"model.num_filters": {"low": 10, "high": 100, "step": 0}}, "step must be a positive number"),
    ({"model.kernel_sizes": {"choices": [[2, 3], [3, 4]]}}, "plain values"),
])
def test_bad_spaces_name_the_setting(space, message):
    with pytest.raises(SpaceError, match=message):
        check_space(space)


def test_space_files_and_grid(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("model.num_filters: {low: 50, high: 150, step: 50}\ntrain.lr: [0.001, 0.003]\n", encoding="utf-8")
    space = load_space(path)
    assert grid(space) == {"model.num_filters": [50, 100, 150], "train.lr": [0.001, 0.003]}
    (tmp_path / "bad.yaml").write_text("train.lr: {low: [\n", encoding="utf-8")
    with pytest.raises(SpaceError, match=r"bad.yaml: not valid UTF-8 YAML: line 2, column 1: "):
        load_space(tmp_path / "bad.yaml")
    (tmp_path / "typo.yaml").write_text("train.lrr: [0.001]\n", encoding="utf-8")
    with pytest.raises(SpaceError, match=r"typo.yaml: unknown field 'train.lrr'"):
        load_space(tmp_path / "typo.yaml")
    (tmp_path / "gbk.yaml").write_bytes("train.lr: [0.001]  # 学习率\n".encode("gbk"))
    with pytest.raises(SpaceError, match="gbk.yaml: not valid UTF-8"):
        load_space(tmp_path / "gbk.yaml")
    with pytest.raises(SpaceError, match="grid sampler needs choices"):
        grid(check_space({"train.lr": {"low": 0.001, "high": 0.01}}))
    with pytest.raises(SpaceError, match="no such file"):
        load_space(tmp_path / "missing.yaml")


def test_concurrent_registrations_leave_the_alias_on_the_best(mlflow_store, tmp_path):
    """Eight runs finishing at once, in a random order: the champion is the best, whatever the interleaving."""
    from tasks.register import F1_TAG, SPLIT_TAG, move_alias

    client = MlflowClient()
    client.create_registered_model("race")
    run = client.create_run(client.create_experiment("race"))
    scores = [0.71, 0.93, 0.64, 0.88, 0.9, 0.77, 0.92, 0.5]
    versions = []
    for f1 in scores:
        v = client.create_model_version("race", str(tmp_path), run.info.run_id).version
        client.set_model_version_tag("race", v, F1_TAG, str(f1))
        client.set_model_version_tag("race", v, SPLIT_TAG, "same-split")
        versions.append(str(v))
    barrier = threading.Barrier(len(scores))

    def register(version, f1):
        barrier.wait()
        move_alias(MlflowClient(), "race", version, f1, "same-split")

    threads = [threading.Thread(target=register, args=(v, f)) for v, f in zip(versions, scores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    best = versions[scores.index(max(scores))]
    assert str(client.get_model_version_by_alias("race", "champion").version) == best
    # and the plain rule: a worse model gets challenger, a better one moves the champion
    assert move_alias(client, "race", versions[0], 0.71, "same-split")[0] == "challenger"
    v = client.create_model_version("race", str(tmp_path), run.info.run_id).version
    assert move_alias(client, "race", str(v), 0.95, "same-split")[0] == "champion"
    assert str(client.get_model_version_by_alias("race", "champion").version) == str(v)


@pytest.mark.slow
def test_sweep_prunes_persists_registers_and_serves(prefect_server, mlflow_store, tmp_path):
    data = write_csv(tmp_path / "reviews.csv", sentiment_rows(60))
    common = ["sweep", "--preset", "tiny", "--dataset", str(data), "--set", "data.max_samples=null", "--set", "train.epochs=3",
              "--set", "train.patience=3", "--set", "prune.amount=0.3", "--study", "s1", "--parallel", "2",
              "--experiment", "sw"]
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train.lr": {"low": 0.01, "high": 0.02}}))
    bad = tmp_path / "bad.json"  # a learning rate that cannot learn: behind the finished trials at its second epoch
    bad.write_text(json.dumps({"train.lr": {"low": 1e-9, "high": 2e-9}}))
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert zhflow(common + ["--trials", "2", "--space", str(good), "--json-out", str(first)]) == 0
    assert zhflow(common + ["--trials", "2", "--space", str(bad), "--json-out", str(second)]) == 0
    one, two = json.loads(first.read_text()), json.loads(second.read_text())

    # the study was continued, not restarted; the hopeless trials were stopped after their second epoch
    assert one["counts"] == {"complete": 2, "pruned": 0, "failed": 0} and two["earlier_trials"] == 2
    assert two["counts"]["pruned"] >= 1 and [r["trial"] for r in two["table"]] == [0, 1, 2, 3]
    study = optuna.load_study(study_name="s1", storage=two["storage"])
    assert len(study.trials) == 4 and two["storage"].endswith("optuna.db")
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned and all(sorted(t.intermediate_values) == [1, 2] for t in pruned)  # never judged on one epoch

    # MLflow: sweep parent -> trial runs (params named as in `zhflow run`) -> stage runs; pruned trials KILLED + tagged
    client = MlflowClient()
    parent = client.get_run(two["parent_run_id"])
    trials = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                                              "and tags.`zhflow.stage` = 'trial'")
    assert len(trials) == 2
    for t in trials:
        assert t.data.params["train.lr"] and t.data.params["model.name"] == "textcnn"
        stages = {r.data.tags["zhflow.stage"] for r in client.search_runs(
            [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{t.info.run_id}'")}
        assert {"preprocess", "train"} <= stages
        if t.data.tags["zhflow.trial_state"] == "pruned":
            assert t.info.status == "KILLED" and "below the median" in t.data.tags["zhflow.pruned_reason"]
            train_run = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{t.info.run_id}' "
                                                                         "and tags.`zhflow.stage` = 'train'")[0]
            logged = [m.step for m in client.get_metric_history(train_run.info.run_id, "val_macro_f1")]
            assert logged == list(range(1, int(t.data.metrics["epochs_run"]) + 1))  # every epoch it ran, once
    done = [t for t in client.search_runs([parent.info.experiment_id], "tags.`zhflow.stage` = 'trial'")
            if t.data.tags["zhflow.trial_state"] == "complete"]
    assert done and all(client.get_metric_history(t.info.run_id, "val_macro_f1") for t in done)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"trials.json", "trials.md", "optimization_history.png", "intermediate_values.png"} <= artifacts
    stages = {r.data.tags.get("zhflow.stage") for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert {"evaluate", "baseline", "register", "trial"} <= stages

    # the champion: the first sweep's best registered as champion; the second sweep's (the same study best, not better) not
    assert one["model"]["alias"] == "champion" and two["model"]["alias"] == "challenger"

    # zhflow predict on the champion
    out = tmp_path / "pred.jsonl"
    assert zhflow(["predict", "--model-uri", f"models:/{one['model']['name']}@champion", "这本书非常好看", "质量太差了",
                   "--json-out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["text"] for r in rows] == ["这本书非常好看", "质量太差了"]
    assert all(r["label"] in ("positive", "negative") and abs(r["prob_positive"] + r["prob_negative"] - 1) < 1e-5 for r in rows)

    # `mlflow models serve` answers /invocations with labels for raw Chinese strings
    _serve_and_post(f"models:/{one['model']['name']}@champion", tmp_path)


def _serve_and_post(model_uri: str, tmp_path) -> None:
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([mlflow_bin, "models", "serve", "-m", model_uri, "--env-manager", "local", "-h", "127.0.0.1",
                               "-p", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              # MLflow starts `uvicorn` from PATH: the environment's bin folder must be on it
                              env=dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the model server did not answer /ping in 120 s"
                time.sleep(1)
        body = json.dumps({"inputs": ["这本书非常好看，值得一读", "质量太差了，很失望"]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
        predictions = answer["predictions"]
        assert len(predictions) == 2 and all(p["label"] in ("positive", "negative") for p in predictions)
    finally:
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


def test_gpu_slices():
    """What each parallel trial gets on a GPU machine (the slicing only: no GPU here)."""
    from tasks.sweep import gpu_slices

    assert gpu_slices(0, 2) == []
    assert gpu_slices(4, 2) == [[0, 1], [2, 3]]
    assert gpu_slices(2, 2) == [[0], [1]]
    assert gpu_slices(1, 3) == [[0], [0], [0]]  # more trials than GPUs: they share


def test_a_trial_whose_process_died_is_run_again_first_and_a_live_one_is_left_alone(tmp_path, monkeypatch):
    """Optuna's heartbeat: a trial that stopped beating for the grace period failed and enqueued with its settings;
    one still beating (a trial of another sweep that is alive) is not touched."""
    import time

    import tasks.sweep as sweeps

    monkeypatch.setattr(sweeps, "HEARTBEAT_S", 1)
    monkeypatch.setattr(sweeps, "GRACE_S", 4)  # wide enough for a loaded machine between a beat and the check
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = sweeps.open_study("s", url, "random", "none", {}, seed=1)
    storage = study._storage  # the beats optimize() records, recorded by hand for trials asked here
    lost, alive = study.ask(), study.ask()
    lr = lost.suggest_float("train.lr", 1e-3, 1e-2)
    alive.suggest_float("train.lr", 1e-3, 1e-2)
    storage.record_heartbeat(lost._trial_id)  # its process was killed: no beat after this one
    done = study.ask()
    done.suggest_float("train.lr", 1e-3, 1e-2)
    study.tell(done, 0.8)
    time.sleep(5.5)  # SQLite's clock counts whole seconds: 4.5 s can read as 4, not past the grace period
    resumed = sweeps.open_study("s", url, "random", "none", {}, seed=1)
    storage.record_heartbeat(alive._trial_id)  # still beating
    assert sweeps.recover_interrupted(resumed) == [lost.number]
    again = resumed.ask()
    assert again.suggest_float("train.lr", 1e-3, 1e-2) == lr
    assert optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(resumed.trials[again.number]) == lost.number
    assert [t.state.name for t in resumed.trials][:3] == ["FAIL", "RUNNING", "COMPLETE"]
    storage.record_heartbeat(alive._trial_id)
    assert sweeps.recover_interrupted(resumed) == []  # nothing else stopped beating


def test_an_interrupt_ends_parallel_trials_at_once_and_the_resumed_study_runs_them_again_first(tmp_path):
    """A Ctrl-C (SIGINT) or a SIGTERM reaches the main thread only; the trials running in Optuna's threads are
    stopped at once (their launchers see ``STOPPING``, as a worker's launcher does) instead of being waited for to
    their end, and end FAIL. The resumed study runs each again first with its settings, at most MAX_RETRY times; a
    trial whose settings were refused or whose worker failed is not run again."""
    import signal
    import time

    import tasks.sweep as sweeps
    from tasks.launch import STOPPING

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    started = {n: threading.Event() for n in range(10)}
    plan = {2: ("wait", 3, signal.SIGINT), 3: ("wait", None, None), 4: ("wait", None, signal.SIGTERM),
            6: ("wait", None, signal.SIGINT), 1: ("failed",)}

    def run(trial):
        lr = trial.suggest_float("train.lr", 1e-4, 1e-2, log=True)
        started[trial.number].set()
        what = plan.get(trial.number, ("complete",))
        if what[0] == "wait":  # a trial training: its launcher stops when the sweep is interrupted
            _, after, sig = what
            if after is not None:
                assert started[after].wait(30)
            if sig is not None:
                os.kill(os.getpid(), sig)
            assert STOPPING.wait(30), "the interrupted sweep did not stop its running trials"
            raise KeyboardInterrupt("train: interrupted")
        failed = what[0] == "failed"
        return {"number": trial.number, "state": "failed" if failed else "complete", "value": None if failed else lr,
                "reason": "settings refused" if failed else None}

    def sigterm(signum, frame):
        raise SystemExit(128 + signum)

    study = sweeps.open_study("i", url, "random", "none", {}, seed=1)
    assert [r["state"] for r in sweeps.optimize(study, 2, 1, run)] == ["complete", "failed"]
    assert study.trials[1].user_attrs["failure"] == "settings refused"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGTERM, sigterm)
    try:
        begun = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            sweeps.optimize(study, 4, 2, run)  # trials 2 and 3 in parallel, a Ctrl-C once both run
        assert time.monotonic() - begun < 30 and not STOPPING.is_set()
        lrs = {t.number: t.params["train.lr"] for t in study.trials}
        assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "FAIL", "FAIL"]
        resumed = sweeps.open_study("i", url, "random", "none", {}, seed=2)
        assert sweeps.recover_interrupted(resumed) == [2, 3]
        assert sweeps.recover_interrupted(resumed) == []  # queued once
        with pytest.raises(SystemExit):
            sweeps.optimize(resumed, 1, 1, run)  # trial 4, the retry of 2, ended by a SIGTERM
        assert resumed.trials[4].state.name == "FAIL" and resumed.trials[4].params["train.lr"] == lrs[2]
        assert sweeps.recover_interrupted(resumed) == [4]
        with pytest.raises(KeyboardInterrupt):
            sweeps.optimize(resumed, 2, 1, run)  # 5 (the retry of 3) completes; 6 (of 2, again) interrupted
        assert [resumed.trials[n].state.name for n in (5, 6)] == ["COMPLETE", "FAIL"]
        assert resumed.trials[5].params["train.lr"] == lrs[3] and resumed.trials[6].params["train.lr"] == lrs[2]
        assert sweeps.recover_interrupted(resumed) == []  # run again MAX_RETRY times: left failed
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    assert [r["state"] for r in sweeps.optimize(resumed, 1, 1, run)] == ["complete"]
    assert resumed.trials[7].params["train.lr"] not in lrs.values()  # a new trial


def test_optimize_runs_trials_as_tasks_of_the_flow_run_and_tells_every_outcome(prefect_server, tmp_path):
    """``study.optimize`` with Prefect tasks: each trial a task run of the flow run (Optuna's threads get its context),
    at most ``parallel`` at once; complete, pruned and failed trials told as such; the grid covered once."""
    import time

    from prefect import flow, task
    from prefect.runtime import flow_run

    import tasks.sweep as sweeps

    events, lock = [], threading.Lock()

    @task(cache_policy=sweeps.NO_CACHE)
    def work(trial) -> dict:
        x = trial.suggest_categorical("x", [0, 1, 2, 3])
        with lock:
            events.append(("start", time.monotonic(), flow_run.id))
        time.sleep(0.3)
        with lock:
            events.append(("end", time.monotonic(), None))
        state = {0: "complete", 1: "pruned", 2: "failed", 3: "complete"}[x]
        return {"number": trial.number, "state": state, "value": float(x) if state == "complete" else None, "reason": state}

    @flow
    def search(trials: int) -> tuple[list, str]:
        study = sweeps.open_study("g", f"sqlite:///{tmp_path / 'o.db'}", "grid", "none", {"x": {"choices": [0, 1, 2, 3]}}, 0)
        return sweeps.optimize(study, trials, 2, work), str(flow_run.id)

    results, run_id = search(4)  # the flow asks no more trials than the grid has points
    assert sorted(r["state"] for r in results) == ["complete", "complete", "failed", "pruned"]
    assert [r["number"] for r in results] == [0, 1, 2, 3]
    assert all(e[2] == run_id for e in events if e[0] == "start")  # the trials ran inside the flow run
    running, most = 0, 0
    for kind, _, _ in sorted(events, key=lambda e: e[1]):
        running += 1 if kind == "start" else -1
        most = max(most, running)
    assert most == 2
    study = optuna.load_study(study_name="g", storage=f"sqlite:///{tmp_path / 'o.db'}")
    states = {t.params["x"]: t.state.name for t in study.trials}
    assert states == {0: "COMPLETE", 1: "PRUNED", 2: "FAIL", 3: "COMPLETE"} and study.best_value == 3.0


def test_a_sweep_from_the_pretrained_family_searches_fine_tuning_settings():
    from training.presets import finetune
    from training.sweep import default_space

    space = check_space(default_space(finetune()))
    assert "model.name" not in space and space["train.lr"]["high"] <= 1e-4
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    config = apply_params(finetune(), suggest(study.ask(), space))
    assert config.model.name == "pretrained" and config.model.pretrained == finetune().model.pretrained
    assert "model.num_filters" in default_space(tiny())  # the tiny preset's TextCNN
    assert check_space(default_space(default()))["model.ngrams"] == {"choices": [2, 3, 4]}  # fastText's own


def test_a_stopped_trial_logs_the_epochs_its_worker_had_not_sent(mlflow_store):
    """The worker sends epoch metrics with the checkpoint that holds them; a trial the pruner stops logs the rest."""
    import mlflow

    from tasks.launch import _log_unsent

    with mlflow.start_run() as run:
        mlflow.log_metric("val_macro_f1", 0.5, step=1)  # epoch 1: sent by the worker with its checkpoint
    history = {1: {"epoch": 1, "sent": True, "val_macro_f1": 0.5, "train_loss_epoch": 0.9},
               2: {"epoch": 2, "sent": False, "val_macro_f1": 0.6, "train_loss_epoch": 0.7},
               3: {"epoch": 3, "sent": False, "val_macro_f1": 0.55, "train_loss_epoch": 0.6}}
    _log_unsent(run.info.run_id, history)
    _log_unsent(run.info.run_id, history)  # the worker sent them at its end: nothing logged twice
    client = MlflowClient()
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_macro_f1")] == [(1, 0.5), (2, 0.6), (3, 0.55)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss_epoch")] == [2, 3]
    assert "sent" not in client.get_run(run.info.run_id).data.metrics


def test_a_slot_an_interrupted_sweep_kept_is_freed_unless_a_trial_of_the_study_runs(prefect_server, tmp_path):
    """A temporary Prefect server forgets its leases when it stops: a slot a sweep took and never gave back (Ctrl-C
    took the server down with it) would keep the next sweep of the study waiting for ever."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    from tasks.sweep import free_stale_slots

    limit = "zhflow-sweep-stale"
    study = optuna.create_study(study_name="stale", storage=f"sqlite:///{tmp_path / 'o.db'}", direction="maximize")
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(limit, 1)
        client.update_global_concurrency_limit(limit, GlobalConcurrencyLimitUpdate(active_slots=1))  # never given back
        running = study.ask()  # another sweep of the study, alive: its slot stays taken
        assert free_stale_slots(study, limit, 2) == 0
        assert client.read_global_concurrency_limit_by_name(limit).active_slots == 1
        study.tell(running, 0.5)
        assert free_stale_slots(study, limit, 2) == 1  # no trial runs: the slot was left behind
        freed = client.read_global_concurrency_limit_by_name(limit)
        assert freed.active_slots == 0 and freed.limit == 2


@pytest.mark.parametrize("args, message", [
    (["--study", "team/reviews"], "--study 'team/reviews': a study name needs a character other than a space, and none of / % & < >"),
    (["--study", "  "], "a study name needs a character other than a space"),
    (["--sampler", "grid"], "the built-in space of textcnn (give one with --space): model.dropout: the grid sampler needs choices"),
    (["--sampler", "grid", "--space", "SPACE"], "space.yaml: train.lr: the grid sampler needs choices or a range with a step"),
    (["--space", "EMPTY"], "empty.yaml: the file names no setting (it is empty, or comments only)"),
])
def test_a_sweep_that_could_not_run_is_refused_before_any_work(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.yaml").write_text("train.lr: {low: 0.001, high: 0.01}\n", encoding="utf-8")
    (tmp_path / "empty.yaml").write_text("# nothing searched yet\n", encoding="utf-8")
    args = [{"SPACE": "space.yaml", "EMPTY": "empty.yaml"}.get(a, a) for a in args]
    with pytest.raises(SystemExit) as refused:
        zhflow(["sweep", "--preset", "tiny", "--trials", "1"] + args)
    assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()  # nothing recorded, no server started


def test_a_trial_told_failed_or_interrupted_is_one_line_a_defect_keeps_its_traceback(tmp_path, caplog):
    """Optuna logs every failed trial with its traceback; for a trial whose reason the message already holds (failed
    of itself, interrupted) that is a screen of frames per trial, for a defect it is what the user needs."""
    from tasks.sweep import TrialFailed, open_study

    study = open_study("logs", f"sqlite:///{tmp_path}/optuna.db", "random", "none", {}, 0)

    def failing(trial):
        raise TrialFailed("train.batch_size: must be at least 1")

    study.optimize(failing, n_trials=1, catch=(TrialFailed,))
    with pytest.raises(KeyboardInterrupt):
        study.optimize(lambda trial: (_ for _ in ()).throw(KeyboardInterrupt("the sweep was interrupted")), n_trials=1)
    with pytest.raises(ZeroDivisionError):
        study.optimize(lambda trial: 1 / 0, n_trials=1)
    err = caplog.text
    assert "Trial 0 failed" in err and "train.batch_size: must be at least 1" in err
    assert "Trial 1 failed" in err and "the sweep was interrupted" in err
    assert "Trial 2 failed" in err and "ZeroDivisionError" in err
    assert err.count("Traceback (most recent call last)") == 1, err  # the defect's only
