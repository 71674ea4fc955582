"""`zhflow evaluate` and the evaluate flow on a real registered model (real Prefect, real MLflow store),
the label-map reader, and the baseline stage on a real prepared dataset."""

import json
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main as zhflow
from tasks.baseline import baseline_model
from tasks.score import EvaluationError, read_label_map
from tests.conftest import sentiment_rows, write_csv
from training.overrides import apply_overrides
from training.presets import tiny
from training.data.prepare import prepare_dataset

ARTIFACTS = {"confusion_matrix.png", "roc_pr_curves.png", "per_class_report.json", "errors.csv", "errors.html",
             "test_predictions.csv"}
CHINESE = {"positive": "好评", "negative": "差评"}


# ---- fast: no model needed ----

def test_label_map_from_json_or_csv(tmp_path):
    as_json = tmp_path / "map.json"
    as_json.write_text('{"好评": "positive", "差评": "negative"}', encoding="utf-8")
    as_csv = tmp_path / "map.csv"
    as_csv.write_text("dataset,model\n好评,positive\n\n差评 , negative\n", encoding="utf-8")
    expected = {"好评": "positive", "差评": "negative"}
    assert read_label_map(as_json) == read_label_map(as_csv) == expected
    gbk = tmp_path / "gbk.csv"
    gbk.write_bytes("from,to\n好评,positive\n".encode("gbk"))
    assert read_label_map(gbk) == {"好评": "positive"}


@pytest.mark.parametrize("content, message", [
    ("dataset,model\n好评,positive,extra\n", "line 2: expected two columns"),
    ('{"好评": "positive",}', "line 1: not valid JSON"),
    ('["好评", "positive"]', "expected a JSON object"),
    ("dataset,model\n", "no mappings"),
])
def test_bad_label_map_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "map.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(EvaluationError, match=message):
        read_label_map(path)
    with pytest.raises(EvaluationError, match="no such file"):
        read_label_map(tmp_path / "absent.json")


def test_evaluate_flow_parameters_are_described():
    """The Prefect UI draws the run form of a future on-demand deployment from this schema."""
    from flows.evaluate import evaluate

    schema = evaluate.parameters.model_dump()
    assert schema["required"] == ["model_uri", "dataset"]
    for name, field in schema["properties"].items():
        assert field.get("description"), name
    assert schema["properties"]["format"]["anyOf"][0]["enum"] == ["csv", "tsv", "jsonl", "parquet"]


def test_missing_file_and_unknown_model_exit_2(mlflow_store, tmp_path, capsys):
    assert zhflow(["evaluate", "--model-uri", "models:/zhflow-classifier@champion", "--dataset", "absent.csv"]) == 2
    err = capsys.readouterr().err
    assert "absent.csv" in err and "neither a built-in corpus" in err and "Traceback" not in err
    csv = write_csv(tmp_path / "reviews.csv", sentiment_rows(3))
    assert zhflow(["evaluate", "--model-uri", "models:/no-such-model@champion", "--dataset", str(csv)]) == 2
    err = capsys.readouterr().err
    assert "models:/no-such-model@champion" in err and "not found" in err and "Traceback" not in err
    assert zhflow(["evaluate", "--model-uri", "m", "--dataset", str(csv), "--label-column", "类别"]) == 2
    assert "no column '类别'; columns are text, label" in capsys.readouterr().err
    assert MlflowClient().get_experiment_by_name("zhflow-evaluate") is None  # nothing recorded


def test_baseline_stage_scores_the_test_split(mlflow_store, tmp_path, small_csv):
    cfg = apply_overrides(tiny(), [f"data.dataset={small_csv}", "data.max_samples=null"])
    prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "prepared")
    client = MlflowClient()
    experiment_id = client.create_experiment("baseline")
    parent = {"run_id": client.create_run(experiment_id).info.run_id, "experiment_id": experiment_id}
    result = baseline_model.fn(cfg, {"path": str(tmp_path / "prepared")}, parent)
    run = client.get_run(result["run_id"])
    assert run.data.tags["mlflow.parentRunId"] == parent["run_id"] and run.data.tags["zhflow.stage"] == "baseline"
    assert run.data.params["baseline.model"] == "tfidf_char_1_3_linear_svc" and run.data.params["baseline.C"] == "0.5"
    test_rows = pd.read_json(tmp_path / "prepared" / "test.jsonl", lines=True)
    assert result["metrics"]["test_texts"] == len(test_rows)
    for key in ("test_accuracy", "test_macro_f1", "test_roc_auc", "test_pr_auc"):
        assert 0 <= result["metrics"][key] <= 1 and run.data.metrics[key] == pytest.approx(result["metrics"][key])
    assert ARTIFACTS <= {a.path for a in client.list_artifacts(run.info.run_id)}


# ---- slow: one tiny model trained by `zhflow run`, then scored on other files ----

@pytest.fixture(scope="module")
def trained(prefect_server, tmp_path_factory):
    """A registered model (zhflow-classifier version 1, champion) in a module-wide MLflow store: ~45 s."""
    root = tmp_path_factory.mktemp("evaluate")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("ZHFLOW_HOME", str(root / "zhflow-home"))
        mp.chdir(root)
        mlflow.set_tracking_uri(uri)
        train_csv = write_csv(root / "train.csv", sentiment_rows(30))
        summary = root / "summary.json"
        argv = ["run", "--preset", "tiny", "--nproc", "1", "--dataset", str(train_csv), "--experiment", "train",
                "--set", "train.epochs=1", "--set", "prune.finetune_epochs=0", "--set", "registry.model_name=zhflow-classifier",
                "--json-out", str(summary)]
        assert zhflow(argv) == 0
        mlflow.set_tracking_uri(None)
    return {"root": root, "uri": uri, "summary": json.loads(summary.read_text())}


@pytest.fixture
def store(trained, monkeypatch, tmp_path):
    """The trained model's store, active for this test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained["uri"])
    monkeypatch.setenv("ZHFLOW_HOME", str(trained["root"] / "zhflow-home"))
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(trained["uri"])
    yield trained["summary"]
    mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_evaluate_records_a_new_run_linked_to_the_model(store, tmp_path, capsys):
    rows = sentiment_rows(20)
    csv = write_csv(tmp_path / "external.csv", rows + [("  ", "negative")])  # a blank text: left out, and said so
    out = tmp_path / "evaluation.json"
    assert zhflow(["evaluate", "--model-uri", "models:/zhflow-classifier@champion", "--dataset", str(csv),
                   "--json-out", str(out)]) == 0
    summary = json.loads(out.read_text(encoding="utf-8"))
    assert summary["blank_texts_dropped"] == 1 and "1 blank row(s) left out" in " ".join(capsys.readouterr().out.split())
    assert summary["classes_never_predicted"] == []
    assert {k: summary[k] for k in ("model_uri", "model_name", "model_version", "experiment", "dataset")} == {
        "model_uri": "models:/zhflow-classifier@champion", "model_name": "zhflow-classifier", "model_version": "1",
        "experiment": "zhflow-evaluate", "dataset": str(csv.resolve())}
    m = summary["metrics"]
    assert m["test_texts"] == len(rows)
    assert {"test_accuracy", "test_macro_f1", "test_macro_precision", "test_macro_recall", "test_roc_auc", "test_pr_auc"} <= set(m)
    assert set(m) <= set(store["metrics"])  # the names `zhflow run` reports
    assert all(0 <= m[k] <= 1 for k in m if k != "test_texts")

    client = MlflowClient()
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "zhflow-evaluate"
    tags = run.data.tags
    assert tags["model_uri"] == "models:/zhflow-classifier@champion"
    assert (tags["registered_model"], tags["model_version"]) == ("zhflow-classifier", "1")
    assert tags["source_run_id"] == store["stage_runs"]["register"] and tags["prefect.flow_run_id"]
    assert run.data.metrics == pytest.approx(m)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == ARTIFACTS
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.tags[0].value == "evaluation" and dataset.dataset.name == "external.csv" and dataset.dataset.digest
    (model_input,) = run.inputs.model_inputs
    assert model_input.model_id == tags["model_id"]
    linked = {metric.key: metric for metric in mlflow.get_logged_model(tags["model_id"]).metrics}
    assert linked["test_macro_f1"].run_id == run.info.run_id and linked["test_macro_f1"].value == pytest.approx(m["test_macro_f1"])
    assert client.get_model_version("zhflow-classifier", "1").tags["last_evaluation_run_id"] == run.info.run_id

    # the predictions are the model's own, text by text
    predictions = pd.read_csv(client.download_artifacts(run.info.run_id, "test_predictions.csv", str(tmp_path)))
    assert predictions["text"].tolist() == [text for text, _ in rows]
    direct = mlflow.pyfunc.load_model("models:/zhflow-classifier/1").predict([text for text, _ in rows])
    assert predictions["predicted"].tolist() == direct["label"].tolist()


@pytest.mark.slow
def test_unknown_labels_fail_clearly_then_a_label_map_fixes_them(store, tmp_path, capsys):
    csv = write_csv(tmp_path / "chinese-labels.csv", [(text, CHINESE[label]) for text, label in sentiment_rows(20)])
    args = ["evaluate", "--model-uri", "models:/zhflow-classifier/1", "--dataset", str(csv), "--experiment", "labels"]
    assert zhflow(args) == 2
    err = capsys.readouterr().err
    assert "'好评', '差评'" in err and "'negative', 'positive'" in err and "--label-map" in err and "Traceback" not in err
    assert MlflowClient().get_experiment_by_name("labels") is None  # failed before any run

    label_map = tmp_path / "labels.json"
    label_map.write_text(json.dumps({v: k for k, v in CHINESE.items()}, ensure_ascii=False), encoding="utf-8")
    out = tmp_path / "evaluation.json"
    assert zhflow([*args, "--label-map", str(label_map), "--json-out", str(out)]) == 0
    summary = json.loads(out.read_text(encoding="utf-8"))
    assert summary["metrics"]["test_texts"] == 40 and summary["experiment"] == "labels"
    assert json.loads(MlflowClient().get_run(summary["run_id"]).data.params["label_map"]) == {"好评": "positive", "差评": "negative"}


@pytest.mark.slow
def test_gbk_file_and_a_run_uri(store, tmp_path):
    rows = sentiment_rows(10)
    csv = write_csv(tmp_path / "gbk.csv", [(text, label) for text, label in rows], header=("评论", "label"), encoding="gbk")
    out = tmp_path / "evaluation.json"
    uri = f"runs:/{store['stage_runs']['register']}/model"
    assert zhflow(["evaluate", "--model-uri", uri, "--dataset", str(csv), "--text-column", "评论",
                   "--json-out", str(out)]) == 0
    summary = json.loads(out.read_text(encoding="utf-8"))
    assert summary["metrics"]["test_texts"] == len(rows)
    assert summary["model_name"] is None and summary["model_version"] is None  # not a registry URI
    tags = MlflowClient().get_run(summary["run_id"]).data.tags
    assert tags["source_run_id"] == store["stage_runs"]["register"] and "registered_model" not in tags


@pytest.mark.slow
def test_a_scheduled_slot_registers_one_model_only(store, trained):
    """A scheduled retrain run again for the same scheduled time (a retry, a re-run from the UI) returns the version
    it registered the first time instead of registering another."""
    from mlflow.tracking import MlflowClient
    from prefect import flow

    from tasks.register import register_model
    from tasks.tracking import open_pipeline_run
    from training.overrides import apply_overrides
    from training.presets import preset

    config = apply_overrides(preset("tiny"), ["registry.model_name=slot-test"])
    checkpoint = next((trained["root"] / "zhflow-home" / "runs" / store["parent_run_id"] / "train").glob("best.pt"))
    evaluated = {"metrics": {"test_macro_f1": 0.61}, "checkpoint": str(checkpoint)}
    prepared = {"path": store["prepared_data"]}

    @flow
    def twice(slot: str) -> list[dict]:
        parent = open_pipeline_run(config, "slots")
        return [register_model(config, evaluated, prepared, parent, slot=slot) for _ in range(2)]

    first, again = twice("deployment-1@2026-11-30T18:00:00+00:00")
    other = twice("deployment-1@2026-12-01T18:00:00+00:00")[0]
    assert first["version"] == again["version"] == "1" and other["version"] == "2"
    versions = MlflowClient().search_model_versions("name = 'slot-test'")
    assert sorted(str(v.version) for v in versions) == ["1", "2"]
    assert again["alias"] == "champion" and other["alias"] == "challenger"  # 0.61 does not beat 0.61


def test_the_logged_model_carries_no_pickle_and_loads_with_pickles_refused(store, monkeypatch):
    """README: Security. The registered model is 'models from code': source, JSON and weights read with
    weights_only; it loads with MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false."""
    import yaml

    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")
    local = Path(mlflow.artifacts.download_artifacts(store["model"]["uri"]))
    files = [p for p in local.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".pkl", ".pickle")]
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    assert "model_code_path" in flavor and "python_model" not in flavor
    predicted = mlflow.pyfunc.load_model(store["model"]["uri"]).predict(["质量很好，物流也快"])
    assert list(predicted["label"]) in (["positive"], ["negative"])


def test_predict_gives_one_row_per_input_line_blank_ones_included(store, tmp_path, capsys):
    lines = ["质量很好，物流也快", "", "太差了，再也不买", "\u200b"]  # a zero-width space: blank once cleaned
    (tmp_path / "texts.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "labels.jsonl"
    assert zhflow(["predict", "--model-uri", store["model"]["uri"], "--input", str(tmp_path / "texts.txt"),
                   "--json-out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["text"] for r in rows] == lines  # row n is line n
    assert all(abs(r["prob_negative"] + r["prob_positive"] - 1) < 1e-5 for r in rows)
    assert "2 blank text(s)" in capsys.readouterr().err
    model = mlflow.pyfunc.load_model(store["model"]["uri"])
    nulls = model.predict(pd.DataFrame({"text": [None, float("nan"), ""]}))  # JSON null: a blank text, never "nan"
    assert nulls.drop(columns="label").nunique().max() == 1  # the three rows alike
