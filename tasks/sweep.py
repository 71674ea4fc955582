"""Sweep tasks: an Optuna study persisted in SQL; each trial is a Prefect task and a nested MLflow run.

A trial trains through the same launcher and DDP worker as ``zhflow run``; every epoch's validation
macro-F1 goes to the study's pruner, and a hopeless trial's process group is ended there and then.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import mlflow
import optuna
from mlflow.tracking import MlflowClient
from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from training.config import ConfigError, PipelineConfig, flatten
from training.models import tokenizer_source
from training.sweep import apply_params, grid, suggest
from tasks.distill import distil
from tasks.launch import STOPPING
from tasks.preprocess import preprocess
from tasks.prune import prune_round
from tasks.tracking import STAGE_TAG, origin_tags, stage_run, work_root
from tasks.train import launch_worker

TRIAL_STATE_TAG = "zhflow.trial_state"


def study_storage() -> str:
    """$ZHFLOW_OPTUNA_STORAGE (e.g. a PostgreSQL URL), else SQLite beside the MLflow SQLite store, else in $ZHFLOW_HOME."""
    if url := os.environ.get("ZHFLOW_OPTUNA_STORAGE"):
        return url
    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).with_name('optuna.db')}"
    work_root().mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{work_root() / 'optuna.db'}"


def make_sampler(name: str, space: dict, seed: int | None) -> optuna.samplers.BaseSampler:
    if name == "grid":  # inside optimize() it stops the study once every combination was tried
        return optuna.samplers.GridSampler(grid(space), seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(name: str) -> optuna.pruners.BasePruner:
    if name == "median":  # stop a trial whose epoch is below the median of finished trials at that epoch
        # from its second epoch: after one, a slower learning rate still sits at the majority class and would be
        # judged on the first steps of its warm-up, not on what it learns
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2)
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    return optuna.pruners.NopPruner()


HEARTBEAT_S, GRACE_S = 20, 90  # a running trial beats every 20 s; one silent for 90 s was lost with its process
MAX_RETRY = 2  # times a trial that did not finish is run again
FAILURE_ATTR = "failure"  # a trial that failed of itself (settings refused, worker failed) says why
INTERRUPTED_ATTR = "interrupted"  # a trial an interrupt ended (Ctrl-C, SIGTERM): run again when the study resumes


def _retry() -> optuna.storages.RetryHeartbeatStaleTrialCallback:
    with warnings.catch_warnings():  # Optuna marks it experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)


class _Storage(optuna.storages.RDBStorage):
    """Trial states changed one at a time in this process. SQLite has no SELECT ... FOR UPDATE: two of a sweep's
    parallel threads could both read a queued trial as WAITING and both set it RUNNING, training it twice into one
    folder (seen with two interrupted trials queued again)."""

    _state_lock = threading.Lock()

    def set_trial_state_values(self, trial_id: int, state: optuna.trial.TrialState, values=None) -> bool:
        with self._state_lock:
            return super().set_trial_state_values(trial_id, state, values)


def storage_of(url: str) -> optuna.storages.RDBStorage:
    """The study's SQL storage with Optuna's heartbeat: a trial whose process died (no beat for GRACE_S) is failed
    by ``fail_stale_trials`` and run again first (``RetryHeartbeatStaleTrialCallback``: the same settings, enqueued)."""
    with warnings.catch_warnings():  # Optuna marks the heartbeat experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _Storage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, heartbeat_stale_trial_callback=_retry())


class _NoTracebackForTold(logging.Filter):
    """Optuna logs every failed trial with its traceback. For a trial an interrupt ended, or one that failed of itself
    (``TrialFailed``: the reason is in the message, and zhflow's summary says it again), that traceback is one screen
    of Optuna's and zhflow's own frames per trial; it is kept for anything else, a defect."""

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.exc_info[0] if record.exc_info else None
        if kind is not None and (issubclass(kind, TrialFailed) or not issubclass(kind, Exception)):
            record.exc_info, record.exc_text = None, None
        return True


def open_study(name: str, storage: str, sampler: str, pruner: str, space: dict, seed: int | None) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    told = logging.getLogger("optuna.study._optimize")  # the logger of "Trial N failed with parameters ..."
    if not any(isinstance(f, _NoTracebackForTold) for f in told.filters):
        told.addFilter(_NoTracebackForTold())
    return optuna.create_study(study_name=name, storage=storage_of(storage), load_if_exists=True, direction="maximize",
                               sampler=make_sampler(sampler, space, seed), pruner=make_pruner(pruner))


def recover_interrupted(study: optuna.Study) -> list[int]:
    """Trials an earlier sweep of the study did not finish, queued again with their settings (each at most MAX_RETRY
    times) so that they run first: those whose process died (their heartbeat stopped: failed here) and those an
    interrupt ended (a Ctrl-C or a SIGTERM: marked ``interrupted`` by ``optimize``). The numbers of those queued."""
    fail = optuna.trial.TrialState.FAIL
    before = {t.number for t in study.get_trials(deepcopy=False, states=(fail,))}
    with warnings.catch_warnings():  # Optuna marks fail_stale_trials and the retry history experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # queues them again itself (storage_of)
        trials = study.get_trials(deepcopy=False)
        stale = {t.number for t in trials if t.state == fail} - before
        retried = {n for t in trials for n in optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(t)}
        # a retry carries its original's attributes: one that then failed of itself is left; so is one run again
        # MAX_RETRY times already (the callback's own rule)
        queued = [t for t in trials if t.state == fail and t.number not in stale | retried
                  and t.user_attrs.get(INTERRUPTED_ATTR) and FAILURE_ATTR not in t.user_attrs
                  and len(optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(t)) < MAX_RETRY]
        retry = _retry()
        for t in queued:
            retry(study, t)
    return sorted(stale | {t.number for t in queued})


def _fail_running(study: optuna.Study, numbers: set[int]) -> None:
    """Trials of ``numbers`` still RUNNING told FAIL, marked interrupted. Optuna fails a trial a KeyboardInterrupt
    ends, but leaves one RUNNING on an exception it does not catch (a SIGTERM's), and only the heartbeat's grace
    period would end it then."""
    try:
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if t.number in numbers:
                study._storage.set_trial_user_attr(t._trial_id, INTERRUPTED_ATTR, True)
                study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    except Exception:  # noqa: BLE001 - the storage itself gone: the heartbeat ends them later; the interrupt goes on
        pass


def free_stale_slots(study: optuna.Study, limit: str, parallel: int) -> int:
    """The study's concurrency limit set to ``parallel`` slots, and the slots still taken freed when no trial of the
    study is running (after ``recover_interrupted``): a trial holds its slot only while it runs, so those are slots a
    sweep that was interrupted never gave back. A temporary Prefect server keeps its leases in memory and forgets them
    when it stops, and the next one would then wait for those slots for ever. Returns how many were freed."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(limit, parallel)
        if study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            return 0  # another sweep of this study is running: its slots are its own
        held = client.read_global_concurrency_limit_by_name(limit).active_slots
        if held:
            client.update_global_concurrency_limit(limit, GlobalConcurrencyLimitUpdate(active_slots=0))
        return held


_GPU_POOLS: dict[str, queue.Queue] = {}  # per sweep: the GPU slices its parallel trials take turns on


def gpu_slices(n_gpus: int, parallel: int) -> list[list[int]]:
    """``parallel`` disjoint slices of the GPUs (trials share GPUs only when there are more trials than GPUs)."""
    if n_gpus == 0:
        return []
    per = max(1, n_gpus // parallel)
    return [[(i * per + j) % n_gpus for j in range(per)] for i in range(parallel)]


def share_gpus(limit: str, parallel: int) -> int | None:
    """Set up the GPU pool of a sweep; the processes each trial gets (None on a CPU machine)."""
    import torch

    slices = gpu_slices(torch.cuda.device_count() if torch.cuda.is_available() else 0, parallel)
    if not slices:
        return None
    pool: queue.Queue = queue.Queue()
    for piece in slices:
        pool.put(piece)
    _GPU_POOLS[limit] = pool
    return len(slices[0])


@contextmanager
def _gpus(limit: str) -> Iterator[list[int] | None]:
    pool = _GPU_POOLS.get(limit)
    if pool is None:
        yield None
        return
    piece = pool.get()
    try:
        yield piece
    finally:
        pool.put(piece)


class TrialFailed(RuntimeError):
    """A trial that could not train (settings the schema refuses, a worker that failed): Optuna records it FAIL and
    the sweep goes on. Any other exception is a defect and stops the sweep."""


def optimize(study: optuna.Study, trials: int, parallel: int, run: Callable[[optuna.Trial], dict]) -> list[dict]:
    """``study.optimize``: Optuna asks, keeps each trial's heartbeat, tells (pruned and failed trials included) and
    stops a used-up grid. ``run(trial)`` is the trial's Prefect task, called in the flow run's context (Optuna's
    threads start without it, so each call gets a copy). The trials' summaries, in trial order.

    Interrupted (a Ctrl-C, a SIGTERM), the trials running end FAIL and marked ``interrupted``: a resumed sweep runs
    them again first (``recover_interrupted``)."""
    context = contextvars.copy_context()
    results: list[dict] = []
    started: set[int] = set()
    lock = threading.Lock()

    def objective(trial: optuna.Trial) -> float:
        if STOPPING.is_set():  # asked after the interrupt: not started (nothing to run again)
            raise KeyboardInterrupt("the sweep was interrupted")
        with lock:
            started.add(trial.number)
        try:
            result = context.copy().run(run, trial)
            if result["state"] == "failed" and STOPPING.is_set():  # its launcher or a server ended by the interrupt
                raise KeyboardInterrupt(result["reason"])
        except BaseException as err:
            if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit, Prefect's TerminationSignal
                trial.set_user_attr(INTERRUPTED_ATTR, True)
            raise
        with lock:
            results.append(result)
        if result["state"] == "pruned":
            raise optuna.TrialPruned(result["reason"])
        if result["state"] == "failed":
            trial.set_user_attr(FAILURE_ATTR, (result["reason"] or "failed")[:2000])  # not run again by a resumed sweep
            raise TrialFailed(result["reason"])
        return result["value"]

    def search() -> None:
        study.optimize(objective, n_trials=trials, n_jobs=parallel, catch=(TrialFailed,))

    STOPPING.clear()
    try:
        if parallel == 1:  # the trial runs in this thread: an interrupt reaches it wherever it is
            search()
        else:
            _search_apart(search)
    except BaseException:
        _fail_running(study, started)
        raise
    finally:
        STOPPING.clear()
    return sorted(results, key=lambda r: r["number"])


def _search_apart(search: Callable[[], None]) -> None:
    """``search()`` in a thread of its own. A Ctrl-C or a SIGTERM reaches the main thread only, which would otherwise
    wait in Optuna's thread pool for the trials running in parallel to end (an hour each, say): here it sets
    ``STOPPING``, every running launcher ends its workers and raises, and the interrupt goes on once they have."""
    failed: list[BaseException] = []
    done = threading.Event()  # not Thread.join: on Python 3.11 a join the signal interrupts marks the thread ended

    def apart() -> None:
        try:
            search()
        except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(err)
        finally:
            done.set()

    try:
        threading.Thread(target=apart, name="sweep-trials", daemon=True).start()
        while not done.wait(0.5):
            pass
    except BaseException as interrupt:
        STOPPING.set()
        while True:
            try:
                if done.wait(0.5):
                    break
            except BaseException:  # noqa: BLE001 - a second Ctrl-C while the trials stop: they stop all the same
                continue
        raise interrupt
    if failed:
        raise failed[0]


@task(name="trial", task_run_name="trial-{trial.number}", cache_policy=NO_CACHE)
def run_trial(base: PipelineConfig, space: dict, trial: optuna.Trial, sweep: dict, pruner: str, cpus: int,
              limit: str) -> dict:
    """One trial: its settings from the study, trained (stopped early if hopeless), pruned if asked; a nested MLflow
    run (KILLED when pruned, FAILED when it failed) and the trial's summary. Optuna tells the study (``optimize``)."""
    logger = get_run_logger()
    params = suggest(trial, space)
    started = time.perf_counter()
    # at most --parallel trials of this study at once on this server, each on its share of the GPUs
    # a lease of 60 s, renewed while this process lives: on a server, a killed sweep's slot is freed within a minute
    with concurrency(limit, occupy=1, lease_duration=60), _gpus(limit) as gpus, mlflow.start_run(
            experiment_id=sweep["experiment_id"], run_name=f"trial-{trial.number}", parent_run_id=sweep["run_id"],
            nested=True, tags={STAGE_TAG: "trial", "optuna.study": trial.study.study_name,
                               "optuna.trial_number": str(trial.number), **origin_tags()}) as run:
        trial_run = {**sweep, "run_id": run.info.run_id, "work_dir": str(Path(sweep["work_dir"]) / f"trial-{trial.number}")}
        try:
            outcome = _train_trial(base, params, trial, trial_run, pruner, cpus, gpus)
        except ConfigError as err:  # a combination the settings refuse
            outcome = {"state": "failed", "value": None, "reason": str(err)}
        except Exception as err:  # noqa: BLE001 - a failed trial is recorded, the sweep goes on
            outcome = {"state": "failed", "value": None, "reason": f"{type(err).__name__}: {err}"}
        seconds = time.perf_counter() - started
        state, value, reason = outcome["state"], outcome["value"], outcome["reason"]
        mlflow.set_tag(TRIAL_STATE_TAG, state)
        if reason:
            mlflow.set_tag("zhflow.failure" if state == "failed" else "zhflow.pruned_reason", reason[:4000])
        mlflow.log_metric("trial_seconds", seconds)
        if state != "complete":
            mlflow.end_run("KILLED" if state == "pruned" else "FAILED")
    logger.info("trial %d %s%s in %.0fs: %s", trial.number, state, f" ({value:.4f})" if value is not None else "",
                seconds, reason or params)
    return {"number": trial.number, "run_id": run.info.run_id, "params": params, "seconds": seconds, **outcome}


def _train_trial(base: PipelineConfig, params: dict, trial: optuna.Trial, trial_run: dict, pruner: str, cpus: int,
                 gpus: list[int] | None) -> dict:
    config = apply_params(base, params)
    mlflow.log_params(flatten(config))
    prepared = preprocess(config.data, config.preprocess, config.augment, trial_run, tokenizer_source(config.model))
    history: list[float] = []
    client = MlflowClient()

    def report(epoch: int, metrics: dict) -> bool:  # the worker's epoch result -> the study's pruner
        history.append(metrics["val_macro_f1"])
        client.log_metric(trial_run["run_id"], "val_macro_f1", metrics["val_macro_f1"], step=epoch)
        trial.report(metrics["val_macro_f1"], epoch)
        return trial.should_prune()

    with stage_run(trial_run, "train") as train_run:
        trained = launch_worker("train", config, prepared, train_run.info.run_id, Path(trial_run["work_dir"]) / "train",
                                on_epoch=report, cpus=cpus, gpus=gpus)
        if trained.get("stopped_by"):
            mlflow.set_tag(TRIAL_STATE_TAG, "pruned")
    mlflow.log_metric("epochs_run", trained["epochs_run"])
    if trained.get("stopped_by"):
        return {"state": "pruned", "value": None, "reason": f"validation macro-F1 {history[-1]:.4f} after epoch "
                f"{trained['stopped_at']} is below the {pruner} rule of the finished trials"}
    checkpoint, value = trained["best_checkpoint"], trained["best_val_macro_f1"]
    if config.prune.amount > 0:
        for round_no, amount in enumerate(config.prune.round_amounts(), 1):
            pruned = prune_round(config, checkpoint, prepared, trial_run, round_no, amount, cpus=cpus, gpus=gpus)
            checkpoint, value = pruned["checkpoint"], pruned["best_val_macro_f1"]
    if config.distill.enabled:  # the trial's model teaches its student; the student is what the trial scores
        prepared, _, student = distil(config, prepared, trial_run, trained["best_checkpoint"], cpus=cpus, gpus=gpus)
        checkpoint, value = student["best_checkpoint"], student["best_val_macro_f1"]
    mlflow.log_metric("best_val_macro_f1", value)
    mlflow.set_tag("checkpoint", checkpoint)
    trial.set_user_attr("checkpoint", checkpoint)  # so that a later sweep of the same study can pick it
    trial.set_user_attr("prepared", prepared["path"])
    trial.set_user_attr("config", config.model_dump(mode="json"))
    return {"state": "complete", "value": value, "reason": "", "checkpoint": checkpoint}


def trials_table(study: optuna.Study) -> list[dict]:
    """Every trial of the study (Optuna's ``trials_dataframe``): number, state, value, epochs, duration and settings."""
    import pandas as pd

    frame = study.trials_dataframe(attrs=("number", "state", "value", "intermediate_values", "duration", "params"))
    if frame.empty:
        return []
    epochs = frame.filter(like="intermediate_values_").notna().sum(axis=1)
    table = pd.DataFrame({"trial": frame["number"], "state": frame["state"].str.lower(), "best_val_macro_f1": frame["value"],
                          "epochs": epochs.where(epochs > 0), "seconds": frame["duration"].dt.total_seconds()})
    for column in frame.filter(like="params_").columns:
        table[column.removeprefix("params_")] = frame[column]
    table = table.astype(object).where(table.notna(), None)
    return [{k: int(v) if k in ("trial", "epochs") and v is not None else v for k, v in row.items()}
            for row in table.to_dict("records")]


def _markdown(frame) -> str:
    def cell(v) -> str:
        return "" if v is None or v != v else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def log_sweep_summary(study: optuna.Study, run_id: str) -> list[dict]:
    """The trials table (MLflow table + markdown), Optuna's optimisation-history and intermediate-values (each
    trial's validation macro-F1 per epoch, pruned ones included) plots on the sweep's parent run."""
    import pandas as pd

    from training.metrics import _pyplot, save_figure

    rows = trials_table(study)
    client = MlflowClient()
    frame = pd.DataFrame(rows)
    client.log_table(run_id, frame, "trials.json")
    with tempfile.TemporaryDirectory() as tmp:
        _pyplot([])  # matplotlib without a display, with a CJK font
        with warnings.catch_warnings():  # Optuna marks its matplotlib plots experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            for name, plot, xlabel in (("optimization_history", optuna.visualization.matplotlib.plot_optimization_history, "trial"),
                                       ("intermediate_values", optuna.visualization.matplotlib.plot_intermediate_values, "epoch")):
                if any(t.state.is_finished() for t in study.trials):
                    ax = plot(study)
                    ax.set(xlabel=xlabel, ylabel="validation macro-F1", title=f"sweep {study.study_name}: {ax.get_title().lower()}")
                    save_figure(ax.figure, Path(tmp) / f"{name}.png")
        (Path(tmp) / "trials.md").write_text(_markdown(frame), encoding="utf-8")
        client.log_artifacts(run_id, tmp)
    return rows
