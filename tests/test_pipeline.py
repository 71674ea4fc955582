"""End to end: the train_pipeline flow on the tiny preset, with a real ephemeral
Prefect server, real torchrun (2 processes) and a temporary MLflow store."""

import json
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main as zhflow
from flows.pipeline import train_pipeline
from training.overrides import apply_overrides
from training.presets import preset, tiny

pytestmark = pytest.mark.slow

STAGES = {"preprocess", "train", "evaluate_trained", "baseline", "prune", "evaluate", "linear", "ensemble", "register"}
TEXTS = ["这本书非常好看，值得一读", "质量太差了，很失望"]


def test_train_pipeline_end_to_end(prefect_server, mlflow_store, tmp_path):
    summary_file = tmp_path / "summary.json"
    assert zhflow(["run", "--preset", "tiny", "--nproc", "2", "--experiment", "e2e", "--json-out", str(summary_file),
                   "--set", "prune.rounds=2", "--set", "prune.schedule=linear"]) == 0
    summary = json.loads(summary_file.read_text())
    client = MlflowClient()

    # the run tree: one parent, one nested run per stage, all finished
    parent = client.get_run(summary["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"]
    assert parent.data.params["train.lr"] == str(tiny().train.lr) and "prune.amount" in parent.data.params
    assert set(summary["stage_runs"]) == STAGES
    for stage, run_id in summary["stage_runs"].items():
        run = client.get_run(run_id)
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["zhflow.stage"] == stage and run.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == len(STAGES)

    # metrics: honest numbers in range, and the worker's per-epoch history from rank 0 only
    m = summary["metrics"]
    for key in ("test_accuracy", "test_macro_f1", "test_macro_precision", "test_macro_recall"):
        assert 0 <= m[key] <= 1
    assert m["sparsity_prunable"] == pytest.approx(0.5, abs=0.01)
    assert 0 <= m["baseline_test_macro_f1"] <= 1 and 0 <= m["trained_test_macro_f1"] <= 1

    # pruning: two rounds (25%, then 50%), each nested under the prune run with its fine-tune epochs
    prune_run = client.get_run(summary["stage_runs"]["prune"])
    pm = prune_run.data.metrics
    assert pm["before_sparsity_prunable"] < 0.05 and pm["after_sparsity_prunable"] == pytest.approx(0.5, abs=0.01)
    for key in ("latency_b1_p50_ms", "latency_b1_p95_ms", "latency_b64_p50_ms", "latency_b64_p95_ms", "file_bytes", "params"):
        assert pm[f"before_{key}"] > 0 and pm[f"after_{key}"] > 0
    assert pm["after_latency_b64_p95_ms"] >= pm["after_latency_b64_p50_ms"]
    assert pm["file_size_ratio"] > 1.3  # half the weights zero, stored as a bitmap
    assert pm["test_macro_f1_after"] == pytest.approx(m["neural_test_macro_f1"])
    assert "pruning_tradeoff.png" in {a.path for a in client.list_artifacts(prune_run.info.run_id)}
    assert len(summary["prune_rounds"]) == 2
    for i, run_id in enumerate(summary["prune_rounds"], 1):
        r = client.get_run(run_id)
        assert r.data.tags["mlflow.parentRunId"] == prune_run.info.run_id and r.data.tags["zhflow.stage"] == f"prune_round_{i}"
        assert r.data.params["prune.round_amount"] == str(0.25 * i)
        assert r.data.metrics["sparsity_prunable"] == pytest.approx(0.25 * i, abs=0.01)
        assert client.get_metric_history(run_id, "val_macro_f1")  # the fine-tune's epochs
    train_run = summary["stage_runs"]["train"]
    epochs = [h.step for h in client.get_metric_history(train_run, "val_macro_f1")]
    assert epochs == list(range(1, len(epochs) + 1)) and epochs
    assert client.get_run(train_run).data.params["nproc_resolved"] == "2"
    evaluate = client.get_run(summary["stage_runs"]["evaluate"])
    assert evaluate.data.metrics["test_macro_f1"] == pytest.approx(m["neural_test_macro_f1"])

    # the candidates: each scored on val and test; the registered one has the best validation macro-F1
    candidates = summary["candidates"]
    assert set(candidates) == {"neural", "linear", "ensemble"}
    assert summary["selected"] == max(candidates, key=lambda name: candidates[name]["val_macro_f1"])
    assert m["test_macro_f1"] == pytest.approx(candidates[summary["selected"]]["test_macro_f1"])
    assert summary["model"]["kind"] == summary["selected"] and parent.data.tags["selected_candidate"] == summary["selected"]
    assert "candidates.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert client.get_run(summary["stage_runs"]["train"]).data.tags["stop_reason"] in ("converged", "max_epochs")
    artifacts = {a.path for a in client.list_artifacts(evaluate.info.run_id)}
    assert {"confusion_matrix.png", "per_class_report.json", "roc_pr_curves.png", "errors.csv", "errors.html"} <= artifacts
    assert evaluate.data.metrics["test_roc_auc"] >= 0 and evaluate.data.metrics["test_pr_auc"] >= 0
    baseline = client.get_run(summary["stage_runs"]["baseline"])
    assert baseline.data.metrics["test_macro_f1"] == pytest.approx(m["baseline_test_macro_f1"])

    # the prepared dataset is an input of the preprocess run, with its digest
    prep = client.get_run(summary["stage_runs"]["preprocess"])
    contexts = {i.tags[0].value: i.dataset.digest for i in prep.inputs.dataset_inputs}
    assert set(contexts) == {"training", "validation", "testing"} and all(contexts.values())
    manifest = json.loads((tmp_path / "zhflow-home" / "prepared").glob("*/manifest.json").__next__().read_text())
    assert manifest["counts"]["duplicates_dropped"] > 0

    # the registered model: champion, and it classifies raw Chinese strings
    model = summary["model"]
    assert model["alias"] == "champion" and model["version"] == "1"
    assert str(client.get_model_version_by_alias(model["name"], "champion").version) == "1"
    predicted = mlflow.pyfunc.load_model(f"models:/{model['name']}@champion").predict(TEXTS)
    assert len(predicted) == 2 and set(predicted["label"]) <= {"negative", "positive"}
    assert (predicted[["prob_negative", "prob_positive"]].sum(axis=1) - 1).abs().max() < 1e-5

    # a second run with the same data reuses the prepared folder; the alias moves only on a win.
    # fastText (the default preset's family), structurally pruned: a smaller model through the same registration path,
    # its TF-IDF settings (sublinear counts, features of one train text left out) kept by the pruned and served model
    cfg = apply_overrides(preset("tiny", "fasttext"), ["train.epochs=1", "prune.finetune_epochs=0", "prune.method=structured",
                                                       "model.sublinear_tf=true", "model.min_df=2"])
    second = train_pipeline(config=cfg, experiment="e2e")
    params = client.get_run(second["parent_run_id"]).data.params
    assert params["model.name"] == "fasttext" and params["model.sublinear_tf"] == "True" and params["model.min_df"] == "2"
    # left to zhflow, fastText trains in one process with every core's threads (its steps are too short for DDP)
    assert client.get_run(second["stage_runs"]["train"]).data.params["nproc_resolved"] == "1"
    small = mlflow.pyfunc.load_model(f"models:/{model['name']}/2")
    assert list(small.predict(TEXTS).columns) == ["label", "prob_negative", "prob_positive"]
    pm2 = client.get_run(second["stage_runs"]["prune"]).data.metrics
    # dimensions removed, not zeroed (the zeros left: the n-gram rows no training text hit, which start at zero)
    assert pm2["after_params"] < 0.6 * pm2["before_params"]
    assert pm2["after_sparsity_prunable"] < pm2["before_sparsity_prunable"] + 0.05
    assert second["preprocess_cached"] is True and second["prepared_data"] == summary["prepared_data"]
    assert client.get_run(second["stage_runs"]["preprocess"]).data.tags["cache_hit"] == "true"
    champion = client.get_model_version_by_alias(model["name"], "champion")
    f1 = {v: float(client.get_model_version(model["name"], v).tags["test_macro_f1"]) for v in ("1", "2")}
    expected = "2" if f1["2"] > f1["1"] else "1"
    assert str(champion.version) == expected
    assert second["model"]["alias"] == ("champion" if expected == "2" else "challenger")


def test_failed_flow_marks_its_mlflow_runs_failed(prefect_server, mlflow_store, tmp_path):
    bad = tmp_path / "one-class.csv"
    bad.write_text("text,label\n" + "\n".join(f"好看{i},positive" for i in range(10)), encoding="utf-8")
    cfg = apply_overrides(tiny(), [f"data.dataset={bad}"])
    with pytest.raises(Exception, match="only one class"):
        train_pipeline(config=cfg, experiment="fails")
    client = MlflowClient()
    exp = client.get_experiment_by_name("fails")
    runs = client.search_runs([exp.experiment_id])
    assert runs and all(r.info.status == "FAILED" for r in runs)
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags][0]
    assert "only one class" in parent.data.tags["zhflow.failure"]


def test_preprocess_cache_reuse_rebuild_and_invalidation(prefect_server, mlflow_store, tmp_path, small_csv):
    import shutil
    import time

    from prefect import flow

    from tasks.preprocess import preprocess
    from tasks.tracking import open_pipeline_run

    @flow
    def prep_only(cfg):
        return preprocess(cfg.data, cfg.preprocess, cfg.augment, open_pipeline_run(cfg, "cache"))

    cfg = apply_overrides(tiny(), [f"data.dataset={small_csv}", "data.max_samples=null"])
    first = prep_only(cfg)
    assert first["cached"] is False
    started = time.perf_counter()
    second = prep_only(cfg)
    assert second["cached"] is True and second["path"] == first["path"]
    assert time.perf_counter() - started < 10  # a whole flow run; the cache hit itself is milliseconds

    shutil.rmtree(first["path"])  # a deleted folder is rebuilt, not a crash
    third = prep_only(cfg)
    assert third["cached"] is False and (Path(third["path"]) / "manifest.json").is_file()

    stop = tmp_path / "stop.txt"
    stop.write_text("购买\n", encoding="utf-8")
    changed = prep_only(apply_overrides(cfg, [f"preprocess.stopwords_file={stop}"]))
    assert changed["cached"] is False and changed["path"] != first["path"]
    stop.write_text("购买\n次\n", encoding="utf-8")  # the file's content, not its name, is in the key
    assert prep_only(apply_overrides(cfg, [f"preprocess.stopwords_file={stop}"]))["path"] != changed["path"]
    assert prep_only(apply_overrides(cfg, ["data.seed=99"]))["path"] != first["path"]


def test_data_prepared_inside_a_task_is_committed_at_once_and_a_killed_holders_lock_is_not_waited_for(
        prefect_server, mlflow_store, tmp_path, small_csv):
    """A sweep trial prepares its data inside its own task: the folder's lock is released and its cache record
    written when the preparing ends, not when the trial does (parallel trials on the same data ran one after the
    other, and a Ctrl-C left the lock for the next sweep to wait on for ever). A lock whose process is gone (killed
    while preparing) is removed; one held by a live process is waited for."""
    from prefect import flow, task

    from tasks.preprocess import OwnedLockManager, preprocess
    from tasks.recover import owner
    from tasks.tracking import open_pipeline_run

    locks = tmp_path / "zhflow-home" / "locks"

    @task
    def trial(cfg, parent):
        prepared = preprocess(cfg.data, cfg.preprocess, cfg.augment, parent)
        return prepared, sorted(p.name for p in locks.iterdir() if p.name.startswith("zhflow-prepare"))

    @flow
    def sweep_like(cfg):
        return trial(cfg, open_pipeline_run(cfg, "locks"))

    @flow
    def parallel_trials(cfg):
        parent = open_pipeline_run(cfg, "locks")
        return [future.result() for future in [trial.submit(cfg, parent), trial.submit(cfg, parent)]]

    cfg = apply_overrides(tiny(), [f"data.dataset={small_csv}", "data.max_samples=null"])
    first, held = sweep_like(cfg)
    assert first["cached"] is False and held == []  # released while the trial still ran
    second, _ = sweep_like(cfg)
    assert second["cached"] is True  # the record was written then too
    # two trials at once on data not prepared yet: one prepares it, the other waits and reads it; both log the splits
    both = parallel_trials(apply_overrides(cfg, ["data.seed=5"]))
    assert sorted(prepared["cached"] for prepared, _ in both) == [False, True]
    assert both[0][0]["path"] == both[1][0]["path"] != first["path"]

    manager = OwnedLockManager(lock_files_directory=locks)
    assert manager.acquire_lock("k", holder="a live trial") and manager.is_locked("k")
    host, pid, start, *rest = (locks / "k.owner").read_text().split(":")
    assert f"{host}:{pid}" == ":".join(owner().split(":")[:2])
    (locks / "k.owner").write_text(":".join([host, pid, str(int(start) + 1), *rest]))  # that process is gone now
    assert not manager.is_locked("k") and not (locks / "k.lock").exists()
    assert manager.acquire_lock("k", holder="the next trial") and manager.is_lock_holder("k", "the next trial")
    manager.release_lock("k", "the next trial")
    assert not list(locks.glob("k.*"))
