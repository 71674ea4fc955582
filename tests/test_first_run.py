"""Two first runs at once in a folder without ``mlflow.db``: the store's schema is created once, under a lock
(``tasks.tracking.init_local_store``), and both runs are recorded. Experiments are marked as model-training ones."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, training_experiment

REPO = Path(__file__).resolve().parent.parent
ZHFLOW = str(Path(sys.executable).with_name("zhflow"))
# each process waits for the same moment, then opens the new store and records a run in it
OPEN_AT = """
import sys, time
while time.time() < float(sys.argv[1]):
    time.sleep(0.001)
from mlflow.tracking import MlflowClient
from tasks.tracking import init_local_store, training_experiment
init_local_store()
client = MlflowClient()
client.set_terminated(client.create_run(training_experiment(client, "first")).info.run_id)
"""


@pytest.mark.slow
def test_processes_opening_a_new_store_at_the_same_moment_all_record_their_run(tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    at = time.time() + 15  # after every process has imported MLflow
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT, str(at)], cwd=REPO, env=env, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(errors)
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("first")
    assert len(client.search_runs([exp.experiment_id])) == 4 and exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


@pytest.mark.slow
def test_two_first_zhflow_runs_at_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "ZHFLOW_HOME")}
    cmd = [ZHFLOW, "run", "--preset", "tiny", "--set", "select.candidates=linear", "--experiment", "two"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parents = client.search_runs([client.get_experiment_by_name("two").experiment_id], "tags.`zhflow.kind` = 'train_pipeline'")
    assert len(parents) == 2 and {r.info.status for r in parents} == {"FINISHED"}


def test_zhflow_experiments_open_on_their_training_runs(mlflow_store):
    client = MlflowClient()
    assert client.get_experiment(training_experiment(client, "new")).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    old = client.create_experiment("made-before")  # an experiment of an older zhflow, untagged: tagged now
    assert training_experiment(client, "made-before") == old
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    mine = client.create_experiment("mine", tags={EXPERIMENT_KIND_TAG: "genai_development"})  # a user's own choice stays
    training_experiment(client, "mine")
    assert client.get_experiment(mine).tags[EXPERIMENT_KIND_TAG] == "genai_development"
