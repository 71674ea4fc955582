"""Evaluation metrics, curves, error analysis and their MLflow record; the TF-IDF + SVM baseline."""


import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from training.baseline import class_scores, fit_baseline
from training.metrics import binary_curves, confident_errors, log_evaluation

ARTIFACTS = {"confusion_matrix.png", "per_class_report.json", "errors.csv", "errors.html", "test_predictions.csv"}


def _two_columns(p_positive: np.ndarray) -> np.ndarray:
    return np.column_stack([1 - p_positive, p_positive])


def test_curves_of_a_perfect_and_a_random_scorer(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 2000)
    png, perfect = binary_curves(y, _two_columns(y * 0.8 + 0.1), ["负面", "正面"], tmp_path / "perfect.png", "perfect")
    assert perfect == {"roc_auc": 1.0, "pr_auc": pytest.approx(1.0)}
    assert png.stat().st_size > 10_000  # a real picture
    _, chance = binary_curves(y, _two_columns(rng.random(2000)), ["负面", "正面"], tmp_path / "random.png", "random")
    assert chance["roc_auc"] == pytest.approx(0.5, abs=0.04)
    assert chance["pr_auc"] == pytest.approx(y.mean(), abs=0.04)  # the PR baseline is the positive share
    # the positive class is labels[1]: scores that rank negatives first give AUC 0
    assert binary_curves(y, _two_columns(1 - y), ["a", "b"], tmp_path / "inverse.png", "inverse")[1]["roc_auc"] == 0.0


def test_curves_need_two_classes_present(tmp_path):
    with pytest.raises(ValueError, match="exactly two classes"):
        binary_curves([0, 1, 2], np.eye(3), ["a", "b", "c"], tmp_path / "x.png", "three")
    with pytest.raises(ValueError, match="both classes"):
        binary_curves([1, 1], _two_columns(np.array([0.2, 0.9])), ["a", "b"], tmp_path / "x.png", "one")


def test_confident_errors_most_confident_first():
    texts = ["好看", "太差", "一般", "不错", "失望"]
    y_true = [1, 0, 1, 1, 0]
    probs = _two_columns(np.array([0.9, 0.7, 0.2, 0.45, 0.95]))  # wrong: 太差 (0.7), 一般 (0.8), 不错 (0.55), 失望 (0.95)
    errors = confident_errors(texts, y_true, probs, ["负面", "正面"])
    assert list(errors.columns) == ["text", "true", "predicted", "prob_predicted", "prob_true"]
    assert errors["text"].tolist() == ["失望", "一般", "太差", "不错"]
    assert errors["prob_predicted"].tolist() == pytest.approx([0.95, 0.8, 0.7, 0.55])
    assert errors.iloc[0][["true", "predicted"]].tolist() == ["负面", "正面"]
    assert errors["prob_true"].tolist() == pytest.approx([0.05, 0.2, 0.3, 0.45])
    assert confident_errors(texts, y_true, probs, ["负面", "正面"], k=2)["text"].tolist() == ["失望", "一般"]
    assert confident_errors(texts, [1, 1, 0, 0, 1], probs, ["负面", "正面"]).empty  # all right


def test_log_evaluation_records_everything_with_chinese_labels(mlflow_store, tmp_path):
    labels = ["差评", "好评"]
    texts = ["质量太差了", "非常满意", "还可以吧", "物流太慢", "推荐购买", "完全不值"]
    y_true = [0, 1, 1, 0, 1, 0]
    probs = _two_columns(np.array([0.1, 0.9, 0.3, 0.8, 0.7, 0.2]))  # 还可以吧 and 物流太慢 wrong
    with mlflow.start_run() as run:
        metrics = log_evaluation(y_true, probs, labels, texts, "测试集")
    assert metrics["test_accuracy"] == pytest.approx(4 / 6) and metrics["test_texts"] == 6
    assert metrics["test_roc_auc"] == pytest.approx(7 / 9) and 0 < metrics["test_pr_auc"] <= 1
    client = MlflowClient()
    logged = client.get_run(run.info.run_id).data.metrics
    assert logged == pytest.approx(metrics)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == ARTIFACTS | {"roc_pr_curves.png"}

    report = mlflow.load_table("per_class_report.json", run_ids=[run.info.run_id])
    assert report["label"].tolist() == ["差评", "好评", "macro avg", "weighted avg"]
    assert set(report.columns) >= {"precision", "recall", "f1", "support"}
    assert report["support"].tolist() == [3, 3, 6, 6]

    folder = tmp_path / "artifacts"
    client.download_artifacts(run.info.run_id, "", str(folder))
    errors = pd.read_csv(folder / "errors.csv")
    assert errors["text"].tolist() == ["物流太慢", "还可以吧"] and errors["true"].tolist() == ["差评", "好评"]
    page = (folder / "errors.html").read_text(encoding="utf-8")
    assert '<meta charset="utf-8">' in page and "物流太慢" in page and "测试集" in page
    predictions = pd.read_csv(folder / "test_predictions.csv")
    assert list(predictions.columns) == ["text", "true", "predicted", "prob_差评", "prob_好评"]
    assert predictions["text"].tolist() == texts and predictions["predicted"].tolist()[:2] == ["差评", "好评"]


def test_three_classes_have_no_curves(mlflow_store):
    labels = ["体育", "财经", "科技"]
    y_true = [0, 1, 2, 2, 1, 0]
    probs = np.array([[0.8, 0.1, 0.1], [0.1, 0.7, 0.2], [0.2, 0.2, 0.6], [0.5, 0.1, 0.4], [0.3, 0.6, 0.1], [0.6, 0.3, 0.1]])
    with mlflow.start_run() as run:
        metrics = log_evaluation(y_true, probs, labels, [f"新闻{i}" for i in range(6)], "three")
    assert "test_roc_auc" not in metrics and "test_pr_auc" not in metrics
    assert metrics["test_accuracy"] == pytest.approx(5 / 6)
    assert {a.path for a in MlflowClient().list_artifacts(run.info.run_id)} == ARTIFACTS


def test_a_class_the_model_never_predicts_is_counted_and_named(mlflow_store):
    labels = ["正常", "投诉", "咨询"]
    y_true = [0, 0, 0, 1, 2, 2]
    probs = np.array([[0.9, 0.05, 0.05]] * 4 + [[0.1, 0.2, 0.7]] * 2)  # the rare 投诉 text read as 正常
    with mlflow.start_run() as run:
        metrics = log_evaluation(y_true, probs, labels, [f"工单{i}" for i in range(6)], "rare")
    assert metrics["test_classes_never_predicted"] == 1.0
    assert MlflowClient().get_run(run.info.run_id).data.tags["test_classes_never_predicted"] == "投诉"
    with mlflow.start_run():
        assert log_evaluation([0, 1], np.eye(2), ["a", "b"], ["x", "y"], "all")["test_classes_never_predicted"] == 0.0


def test_log_evaluation_names_a_shape_mismatch(mlflow_store):
    with mlflow.start_run(), pytest.raises(ValueError, match=r"one column per label \(2, 3\)"):
        log_evaluation([0, 1], np.ones((2, 2)) / 2, ["a", "b", "c"], ["x", "y"], "bad")


def test_baseline_scores_rank_like_its_predictions():
    texts = ["质量很好", "内容精彩", "非常满意", "太差了", "很失望", "不推荐"] * 3
    labels = [1, 1, 1, 0, 0, 0] * 3
    model = fit_baseline(texts, labels)
    scores = class_scores(model, ["质量很好，非常满意", "太差了，很失望"])
    assert scores.shape == (2, 2) and np.allclose(scores.sum(1), 1)
    assert scores.argmax(1).tolist() == model.predict(["质量很好，非常满意", "太差了，很失望"]).tolist() == [1, 0]
    three = fit_baseline(["体育比赛", "足球比赛", "股票上涨", "基金下跌", "手机芯片", "电脑芯片"] * 2, ["a", "a", "b", "b", "c", "c"] * 2)
    scores = class_scores(three, ["篮球比赛", "股票基金"])
    assert scores.shape == (2, 3) and list(three.classes_[scores.argmax(1)]) == ["a", "b"]
