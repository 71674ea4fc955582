"""The one place that knows how MLflow runs are named, tagged and nested.

One parent run per flow run (tagged with the Prefect flow run id, its UI URL
and the git commit), one nested run per stage. Tracking URI: MLFLOW_TRACKING_URI
if set, else MLflow's local default (``mlflow.db`` in the working folder).

MLflow's HTTP calls retry at most ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` times (3 unless set; MLflow's own default,
7, backs off for minutes) with a ``MLFLOW_HTTP_REQUEST_TIMEOUT`` of 30 s: a tracking server that goes away mid-run
ends the run with an error in bounded time. The training processes inherit both.

Models are loaded with ``MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false`` unless set: zhflow's models are "models from
code" (no pickle), so a model whose MLmodel file was changed to load a pickled object is refused, not run.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.runtime import flow_run

import training
from tasks import MLFLOW_DEFAULTS, apply_mlflow_defaults  # noqa: F401  (MLFLOW_DEFAULTS: documented above)
from tasks.recover import OWNER_TAG, owner, recover
from training.config import PipelineConfig, flatten

apply_mlflow_defaults()

PARENT_KIND_TAG = "zhflow.kind"
STAGE_TAG = "zhflow.stage"
FLOW_RUN_TAG = "prefect.flow_run_id"


def work_root() -> Path:
    """Where prepared data and checkpoints go: $ZHFLOW_HOME, else ./.zhflow."""
    return Path(os.environ.get("ZHFLOW_HOME", ".zhflow")).resolve()


def mlflow_ui_base() -> str:
    """The MLflow UI's address: the tracking server itself, else $ZHFLOW_MLFLOW_UI_URL, else where `mlflow ui` serves."""
    uri = mlflow.get_tracking_uri()
    if uri.startswith(("http://", "https://")):
        parts = urlsplit(uri)
        return urlunsplit((parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""), parts.path.rstrip("/"), "", ""))
    return os.environ.get("ZHFLOW_MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")


def mlflow_run_url(experiment_id: str, run_id: str) -> str:
    return f"{mlflow_ui_base()}/#/experiments/{experiment_id}/runs/{run_id}"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def origin_tags() -> dict[str, str]:
    """Tags of every run zhflow creates: its Prefect flow run, and the process that owns it (for ``tasks.recover``)."""
    tags = {OWNER_TAG: owner()}
    if flow_run.id:
        tags[FLOW_RUN_TAG] = str(flow_run.id)
        tags["prefect.flow_run_name"] = str(flow_run.name)
        tags["prefect.flow_name"] = str(flow_run.flow_name)
        if flow_run.ui_url and not str(flow_run.ui_url).startswith("None"):  # the temporary server has no UI URL
            tags["prefect.flow_run_url"] = str(flow_run.ui_url)
    return tags


def init_local_store() -> None:
    """Create a local SQLite tracking store's schema under a file lock: two first runs started together in a folder
    without ``mlflow.db`` would otherwise both run MLflow's migrations on the same new file, and one fails
    (``Online migration expected to match one row``). Once the schema exists, the lock costs one open."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith("sqlite:///"):
        return
    from filelock import FileLock
    from mlflow.tracking._tracking_service.utils import _get_store

    path = Path(uri[len("sqlite:///"):].split("?")[0])  # sqlite:///rel.db or sqlite:////abs.db
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=600):
        _get_store()  # MLflow creates or upgrades the schema as it opens the store


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # the MLflow UI opens an experiment on its training runs, not the GenAI view
EXPERIMENT_KIND = "custom_model_development"


def training_experiment(client: MlflowClient, name: str) -> str:
    """The id of experiment ``name``, created if missing (a run started at the same moment may create it first),
    marked as a model-training experiment unless its kind is already set."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException as err:
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise err
    if EXPERIMENT_KIND_TAG not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


@task(name="open-mlflow-run")
def open_pipeline_run(config: PipelineConfig, experiment: str, kind: str = "train_pipeline") -> dict:
    """Create the parent run and log every setting as a flat param (``train.lr``); first settle what killed
    zhflow processes left behind (``tasks.recover``)."""
    init_local_store()
    client = MlflowClient()
    settled = recover(client)
    if settled["ended_processes"] or settled["failed_runs"]:
        get_run_logger().warning("settled what killed zhflow processes left behind: ended process(es) %s; marked FAILED "
                                 "the MLflow run(s) they left RUNNING: %s", settled["ended_processes"] or "none",
                                 settled["failed_runs"] or "none")
    experiment_id = training_experiment(client, experiment)
    tags = {PARENT_KIND_TAG: kind, "zhflow.version": training.__version__, **origin_tags()}
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    # the parent spans the flow's tasks, which run in other threads, and MLflow's fluent runs are per thread: so the client
    # opens it here and close_pipeline_run ends it (fail_open_runs marks it FAILED if the flow fails)
    run = client.create_run(experiment_id, run_name=str(flow_run.name or kind), tags=tags)
    params = [Param(k, str(v)) for k, v in flatten(config).items()]
    client.log_batch(run.info.run_id, params=params)  # MLflow splits it into requests of at most 100 params
    work_dir = work_root() / "runs" / run.info.run_id
    work_dir.mkdir(parents=True, exist_ok=True)
    url = mlflow_run_url(experiment_id, run.info.run_id)
    get_run_logger().info("MLflow run %s in experiment %r at %s: %s", run.info.run_id, experiment, mlflow.get_tracking_uri(), url)
    link_to_mlflow(experiment_id, experiment, run.info.run_id)
    return {"run_id": run.info.run_id, "experiment_id": experiment_id, "experiment": experiment, "work_dir": str(work_dir)}


def _earlier_stage_run(parent: dict, stage: str):
    # MLflow has no get-or-create for runs: a retried task finds the run its first attempt opened by parent and stage tag
    earlier = MlflowClient().search_runs(
        [parent["experiment_id"]],
        filter_string=f"tags.mlflow.parentRunId = '{parent['run_id']}' and tags.`{STAGE_TAG}` = '{stage}'",
        max_results=1,
    )
    return earlier[0] if earlier else None


@task(name="open-stage-run")
def open_stage_run(parent: dict, stage: str) -> dict:
    """A nested run that stays open across tasks (the prune stage, parent of its rounds); shaped like the parent
    dict, so ``stage_run(open_stage_run(parent, "prune"), "prune_round_1")`` nests one level deeper."""
    client = MlflowClient()
    earlier = _earlier_stage_run(parent, stage)
    if earlier is not None:
        run_id = earlier.info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        run_id = client.create_run(parent["experiment_id"], run_name=stage, tags={
            STAGE_TAG: stage, "mlflow.parentRunId": parent["run_id"], **origin_tags()}).info.run_id
    work_dir = Path(parent["work_dir"]) / stage
    work_dir.mkdir(parents=True, exist_ok=True)
    return {**parent, "run_id": run_id, "work_dir": str(work_dir), "parent_run_id": parent["run_id"]}


@contextmanager
def stage_run(parent: dict, stage: str) -> Iterator[mlflow.ActiveRun]:
    """A nested run for one stage; FAILED if the body raises.

    A retried task finds its stage's earlier run under the same parent and continues it (with the
    stage's folder, so training resumes from its last checkpoint) instead of starting a second one.
    """
    earlier = _earlier_stage_run(parent, stage)
    if earlier is not None:
        MlflowClient().set_tag(earlier.info.run_id, "zhflow.attempts", str(int(earlier.data.tags.get("zhflow.attempts", "1")) + 1))
        with mlflow.start_run(run_id=earlier.info.run_id, nested=True, parent_run_id=parent["run_id"]) as run:
            yield run
        return
    with mlflow.start_run(
        experiment_id=parent["experiment_id"], run_name=stage, parent_run_id=parent["run_id"], nested=True,
        tags={STAGE_TAG: stage, **origin_tags()},
    ) as run:
        yield run


@task(name="close-mlflow-run")
def close_pipeline_run(parent: dict, metrics: dict[str, float], tags: dict[str, str] | None = None,
                       artifact_key: str = "metrics") -> None:
    """Log the final metrics and tags, end the run FINISHED, and put the table in the Prefect artifact
    ``artifact_key`` (a stage closed this way, the prune stage, names its own: one ``metrics`` per flow run)."""
    client = MlflowClient()
    now = int(time.time() * 1000)
    client.log_batch(parent["run_id"], metrics=[Metric(key, float(value), now, 0) for key, value in metrics.items()],
                     tags=[RunTag(key, str(value)) for key, value in (tags or {}).items()])
    client.set_terminated(parent["run_id"], "FINISHED")
    metrics_artifact(parent["experiment_id"], parent["experiment"], parent["run_id"], metrics, tags, key=artifact_key)


def link_to_mlflow(experiment_id: str, experiment: str, run_id: str) -> None:
    """In a Prefect flow run: a link artifact to its MLflow run (the MLflow run carries the Prefect run's id and URL)."""
    if flow_run.id:
        create_link_artifact(mlflow_run_url(experiment_id, run_id), link_text=f"MLflow run {run_id} ({experiment})",
                             key="mlflow-run", description="The MLflow run of this flow run: params, metrics, nested runs, model")


def metrics_artifact(experiment_id: str, experiment: str, run_id: str, metrics: dict[str, float],
                     tags: dict[str, str] | None = None, key: str = "metrics") -> None:
    """In a Prefect flow run: a markdown artifact with the final metrics table and a link to the MLflow run."""
    if not flow_run.id:
        return
    rows = "\n".join(f"| {key} | {float(value):.4f} |" for key, value in sorted(metrics.items()))
    extra = "\n".join(f"- **{key}**: {value}" for key, value in (tags or {}).items())
    create_markdown_artifact(
        f"## Metrics\n\n[MLflow run {run_id}]({mlflow_run_url(experiment_id, run_id)}) in experiment `{experiment}`\n\n"
        f"{extra}\n\n| metric | value |\n|---|---|\n{rows}\n",
        key=key, description="Final metrics of this run, as logged to MLflow")


def fail_open_runs(flow, flow_run_obj, state) -> None:
    """Flow hook (failure, crash, cancellation): runs of this flow run left RUNNING become FAILED, with the reason.
    With the tracking server gone, a warning: the next start on this machine marks them (``tasks.recover``)."""
    client = MlflowClient()
    try:
        runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            filter_string=f"tags.`{FLOW_RUN_TAG}` = '{flow_run_obj.id}' and attributes.status = 'RUNNING'",
        )
    except MlflowException as err:
        logging.getLogger(__name__).warning("could not mark this flow run's MLflow runs FAILED (%s); the next zhflow start "
                                            "on this machine does", str(err).splitlines()[0][:300])
        return
    for run in runs:
        client.set_tag(run.info.run_id, "zhflow.failure", (state.message or state.name)[:4000])
        client.set_terminated(run.info.run_id, "KILLED" if state.is_cancelled() else "FAILED")
