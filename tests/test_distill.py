"""Knowledge distillation: the loss, the teachers (checkpoint, cross-fitted TF-IDF, served model URI) and their cache,
the distill stage in `zhflow run` and `zhflow distill`, and what is refused before any training."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import sentiment_rows, write_csv
from tests.test_pretrained import _zhflow
from training.config import ConfigError, DistillError, validate
from training.data.prepare import prepare_dataset
from training.distill import (WithTeacher, baseline_teacher, kd_loss, pyfunc_teacher, soften, transfer_texts)
from training.evaluate import open_split
from training.overrides import apply_overrides
from training.presets import on_preset, tiny

@pytest.fixture(scope="module")
def reviews(tmp_path_factory) -> Path:
    return write_csv(tmp_path_factory.mktemp("data") / "reviews.csv", sentiment_rows(40))


@pytest.fixture(scope="module")
def prepared(reviews, tmp_path_factory) -> Path:
    cfg = apply_overrides(tiny(), [f"data.dataset={reviews}", "data.max_samples=null", "augment.enabled=true"])
    out = tmp_path_factory.mktemp("prepared") / "p"
    prepare_dataset(cfg.data, cfg.preprocess, out, augment=cfg.augment)
    return out


def test_the_loss_is_cross_entropy_at_alpha_0_and_zero_when_the_student_agrees_at_alpha_1():
    torch.manual_seed(0)
    logits, labels = torch.randn(8, 3), torch.randint(0, 3, (8,))
    teacher = torch.softmax(torch.randn(8, 3), 1)
    assert torch.allclose(kd_loss(logits, teacher, labels, 2.0, 0.0), F.cross_entropy(logits, labels))
    # a student whose logits are the teacher's log-probabilities agrees at every temperature
    agreeing = torch.log(teacher)
    for t in (1.0, 2.0, 5.0):
        assert kd_loss(agreeing, teacher, labels, t, 1.0).abs() < 1e-5
    assert torch.allclose(soften(teacher, 1.0), teacher, atol=1e-6)
    assert (soften(teacher, 4.0).max(1).values < teacher.max(1).values).all()  # a higher temperature: flatter
    # the T^2 factor: the soft term's gradient keeps its scale as T grows (Hinton et al.)
    grads = []
    for t in (2.0, 8.0):
        z = logits.clone().requires_grad_()
        kd_loss(z, teacher, labels, t, 1.0).backward()
        grads.append(z.grad.norm().item())
    assert 0.2 < grads[1] / grads[0] < 5
    # unlabelled rows (label -1) get the soft term only; a batch of only those has no hard term at all
    unlabelled = torch.full((8,), -1)
    assert torch.allclose(kd_loss(logits, teacher, unlabelled, 2.0, 0.5), 0.5 * kd_loss(logits, teacher, unlabelled, 2.0, 1.0))


def test_batches_carry_the_teachers_probabilities_of_their_own_rows(prepared):
    cfg = tiny()
    split = open_split(prepared, "train", cfg.model, cfg.preprocess.max_len)
    probs = np.random.default_rng(0).dirichlet([1, 1], size=len(split)).astype(np.float32)
    data = WithTeacher(split, probs)
    rows = [5, 0, 17]
    inputs, labels, teacher = data.collate([data[i] for i in rows])
    assert torch.equal(teacher, torch.from_numpy(probs[rows]))
    assert labels.tolist() == [int(split.labels[i]) for i in rows]
    with pytest.raises(DistillError, match="rows"):
        WithTeacher(split, probs[:-1])


def test_augmented_copies_are_in_the_transfer_set_as_texts(prepared):
    texts = transfer_texts(prepared)
    assert len(texts) == len(np.load(prepared / "train.labels.npy")) and texts["augmented"].any()
    assert not texts.loc[texts["augmented"], "text"].str.contains(" ").any()  # tokens joined back into a text


def test_the_baseline_teacher_is_cross_fitted_on_train_only(prepared):
    labels = np.load(prepared / "train.labels.npy")
    probs, info, fitted = baseline_teacher(prepared, labels, 2, folds=4, seed=1)
    assert probs.shape == (len(labels), 2) and np.allclose(probs.sum(1), 1, atol=1e-5)
    assert info["folds"] == 4 and info["C"] in (1.0, 10.0, 100.0)
    assert info["oof_accuracy"] > 0.75  # templated reviews: a cross-fitted model that learned nothing is near 0.5
    # out-of-fold: less sure of its train texts than the same model fitted on all of them
    texts = transfer_texts(prepared)["clean"].tolist()
    in_fold = fitted.predict_proba(texts)
    assert probs.max(1).mean() < in_fold.max(1).mean()
    # it never saw val or test: the fitted vocabulary has no n-gram found only there
    seen = set(fitted[0].vocabulary_)
    val_only = set("".join(transfer_texts(prepared, "test")["clean"])) - set("".join(texts))
    assert not (val_only & seen)


def test_folders_of_the_same_texts_share_the_teachers_probabilities_and_other_texts_or_labels_do_not(prepared, tmp_path):
    """The teacher cache is keyed on what the teacher reads: another student's folder of the same texts (more n-gram
    buckets, say) reads the probabilities a transformer teacher took half an hour to give; a changed label does not."""
    import shutil

    from tasks.distill import transfer_digest

    other = shutil.copytree(prepared, tmp_path / "other-student")
    for vocab in other.glob("*vocab*"):  # what a student's sizes change: not what the teacher reads
        vocab.unlink() if vocab.is_file() else shutil.rmtree(vocab)
    assert transfer_digest(str(other)) == transfer_digest(str(prepared))
    labels = np.load(other / "test.labels.npy")
    labels[0] = 1 - labels[0]
    np.save(other / "test.labels.npy", labels)
    assert transfer_digest(str(other)) != transfer_digest(str(prepared))


def test_a_served_teacher_is_read_in_this_datas_label_order_and_other_labels_are_refused():
    def predict(frame):
        n = len(frame)
        return pd.DataFrame({"label": ["b"] * n, "prob_b": [0.9] * n, "prob_a": [0.1] * n})

    probs = pyfunc_teacher(predict, "models:/m/1", ["x", "y", "z"], ["a", "b"], batch_size=2)
    assert np.allclose(probs, [[0.1, 0.9]] * 3)
    with pytest.raises(DistillError, match=r"models:/m/1: its labels \['a', 'b'\] are not this data's labels \['a', 'c'\]"):
        pyfunc_teacher(predict, "models:/m/1", ["x"], ["a", "c"])


def test_the_settings_refuse_what_cannot_teach():
    with pytest.raises(ConfigError, match="distill.teacher.*'bert' is neither"):
        validate({"distill": {"teacher": ["bert"]}})
    with pytest.raises(ConfigError, match="distill.teacher: 'trained' is the run's neural model: keep neural in select.candidates"):
        validate({"distill": {"enabled": True, "teacher": ["trained"]}, "select": {"candidates": ["linear"]}})
    with pytest.raises(ConfigError, match="list at least one"):
        validate({"select": {"candidates": []}})
    assert validate({"distill": {"enabled": True, "teacher": ["baseline"]}, "select": {"candidates": []}}).distill.enabled
    # a nested setting, as --set and the Prefect form give it; the preset fills the rest of the student
    cfg = apply_overrides(tiny(), ["distill.student.name=bilstm", "distill.train.lr=0.01", "distill.temperature=4"])
    assert (cfg.distill.student.name, cfg.distill.train.lr, cfg.distill.temperature) == ("bilstm", 0.01, 4.0)
    typed = on_preset(validate({"distill": {"student": {"dropout": 0.1}}}), "tiny")
    assert typed.distill.student.dropout == 0.1 and typed.distill.student.embed_dim == tiny().distill.student.embed_dim
    with pytest.raises(ConfigError, match="distill.student is a section"):
        apply_overrides(tiny(), ["distill.student=textcnn"])


TINY = ["--preset", "tiny", "--set", "data.max_samples=null", "--set", "train.epochs=6", "--set", "train.patience=6",
        "--set", "distill.train.epochs=6", "--set", "distill.train.patience=6", "--set", "prune.amount=0"]


@pytest.mark.slow
def test_a_run_distils_a_student_and_zhflow_distill_learns_from_a_registered_model(reviews, tmp_path, prefect_api):
    from mlflow.tracking import MlflowClient
    import mlflow

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": store, "PREFECT_API_URL": prefect_api}
    out = tmp_path / "run.json"
    run = _zhflow(["run", *TINY, "--dataset", str(reviews), "--distill", "baseline,trained", "--json-out", str(out)], tmp_path, env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert "distilled" in summary["candidates"]
    m = summary["metrics"]
    assert m["distill_distilled_test_macro_f1"] > 0.8  # templated reviews: a student that learned nothing is ~0.33-0.5
    # the run's own TextCNN is the same student trained alone: compared, not trained twice
    for key in ("teacher_test_macro_f1", "alone_test_macro_f1", "alone_latency_b64_p50_ms", "distilled_params",
                "distilled_file_bytes", "distilled_latency_b1_p95_ms"):
        assert f"distill_{key}" in m
    assert m["distill_alone_test_macro_f1"] == m["trained_test_macro_f1"]
    assert "distilled" in run.stdout or "distill" in run.stdout
    assert "teacher trained: " in run.stdout + run.stderr and "texts labelled (100%)" in run.stdout + run.stderr  # shown as it goes

    mlflow.set_tracking_uri(store)
    try:
        client = MlflowClient()
        distill_run = client.get_run(summary["stage_runs"]["distill"])
        children = client.search_runs([distill_run.info.experiment_id], f"tags.mlflow.parentRunId = '{distill_run.info.run_id}'")
        assert {r.data.tags["zhflow.stage"] for r in children} == {"train_student", "evaluate_student"}
        assert distill_run.info.status == "FINISHED" and distill_run.data.params["distill.teacher"] == "['baseline', 'trained']"
        table = mlflow.artifacts.load_text(f"runs:/{distill_run.info.run_id}/comparison.md")
        assert "textcnn distilled" in table and "teacher (baseline + trained)" in table
        (student_train,) = [r for r in children if r.data.tags["zhflow.stage"] == "train_student"]
        assert float(student_train.data.params["distill.alpha"]) == 0.7
        uri = summary["model"]["uri"]
    finally:
        mlflow.set_tracking_uri(None)

    # zhflow distill: the registered model and the baseline teach; the baseline's probabilities come from the cache
    out2 = tmp_path / "distill.json"
    again = _zhflow(["distill", *TINY, "--dataset", str(reviews), "--teacher", f"baseline,{uri}", "--json-out", str(out2)],
                    tmp_path, env)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    second = json.loads(out2.read_text())
    assert set(second["candidates"]) == {"distilled"} and second["selected"] == "distilled"
    assert second["model"]["kind"] == "distilled"  # the summary names the registered candidate, not how it is served
    assert "zhflow distill" in again.stdout and "zhflow run" in run.stdout  # each summary titled by its command
    assert second["metrics"]["distill_distilled_test_macro_f1"] > 0.8
    assert f"teacher {uri}: " in again.stdout + again.stderr and "texts labelled (100%)" in again.stdout + again.stderr
    mlflow.set_tracking_uri(store)
    try:
        client = MlflowClient()
        distill_run = client.get_run(second["stage_runs"]["distill"])
        teachers = json.loads(distill_run.data.tags["teachers"])
        assert [t["cached"] for t in teachers] == [True, False]  # the baseline's from the first run; the URI's new
        stages = {r.data.tags["zhflow.stage"] for r in client.search_runs(
            [distill_run.info.experiment_id], f"tags.mlflow.parentRunId = '{distill_run.info.run_id}'")}
        assert stages == {"train_alone", "evaluate_alone", "train_student", "evaluate_student"}  # nothing to compare with
        version = client.get_model_version(second["model"]["name"], second["model"]["version"])
        assert version.tags["teacher"] == f"baseline,{uri}" and float(version.tags["teacher_test_macro_f1"]) > 0.8
        assert version.tags["candidate"] == "distilled"
        assert client.get_run(second["parent_run_id"]).info.run_name.startswith("distill-textcnn-")  # not train-
    finally:
        mlflow.set_tracking_uri(None)

    # a teacher of other labels: refused after preprocessing, before any training, naming both label sets
    relabelled = write_csv(tmp_path / "stars.csv", [(t, {"positive": "5星", "negative": "1星"}[l]) for t, l in sentiment_rows(40)])
    refused = _zhflow(["distill", *TINY, "--dataset", str(relabelled), "--teacher", uri], tmp_path, env)
    assert refused.returncode != 0
    assert "['negative', 'positive'] are not this data's labels ['1星', '5星']" in refused.stderr
    mlflow.set_tracking_uri(store)
    try:
        client = MlflowClient()
        trained = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                     "tags.`zhflow.stage` = 'train_alone'")
        assert len(trained) == 1  # only the second run's
    finally:
        mlflow.set_tracking_uri(None)
    missing = _zhflow(["distill", *TINY, "--dataset", str(reviews), "--teacher", "models:/no-such-model/1"], tmp_path, env)
    assert missing.returncode == 2 and "zhflow: error: distill.teacher models:/no-such-model/1: cannot load it" in missing.stderr


@pytest.mark.slow
def test_a_tokenizer_teacher_teaches_a_jieba_word_student(tiny_bert, reviews, tmp_path, prefect_api):
    """The fine-tuned encoder reads its tokenizer's ids, the TextCNN student jieba words: one prepared folder holds
    both, and the student's served model needs jieba while the teacher's did not."""
    import mlflow

    out = tmp_path / "run.json"
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PREFECT_API_URL": prefect_api}
    unlabelled = tmp_path / "more.txt"
    unlabelled.write_text("这家店的咖啡香浓可口\n物流慢得让人生气\n屏幕清晰，续航一般\n", encoding="utf-8")
    run = _zhflow(["run", "--preset", "tiny", "--pretrained", str(tiny_bert), "--dataset", str(reviews), "--distill", "trained",
                   "--unlabelled", str(unlabelled),
                   "--set", "data.max_samples=null", "--set", "train.lr=2e-3", "--set", "train.epochs=12", "--set", "train.batch_size=8",
                   "--set", "train.patience=12", "--set", "train.schedule=constant", "--set", "prune.amount=0",
                   "--set", "preprocess.max_len=24", "--set", "select.candidates=neural", "--set", "distill.student.input=word",
                   "--set", "distill.train.epochs=8", "--set", "distill.train.patience=8", "--set", "distill.alpha=0.9",
                   "--set", "distill.augment_copies=1", "--set", "distill.span_copies=1",
                   "--json-out", str(out)], tmp_path, env=env, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads(out.read_text())
    m = summary["metrics"]
    assert m["distill_teacher_test_macro_f1"] > 0.8 and m["distill_distilled_test_macro_f1"] > 0.8
    assert m["distill_speedup_b64_vs_teacher"] > 0  # the teacher is a checkpoint: timed like the student
    assert m["prune_speedup_b64"] == m["prune_speedup_b1"] == 1.0  # prune.amount=0: the trained model, timed once
    assert {"alone", "distilled"} <= {k.split("_")[1] for k in m if k.startswith("distill_")}
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    try:
        client = mlflow.MlflowClient()
        distilled_eval = client.get_run(summary["stage_runs"]["distilled"])
        checkpoint = distilled_eval.data.tags["checkpoint"]
        distill_id = summary["stage_runs"]["distill"]
        # the trained teacher labels the transfer set in the precision its registration would choose (bf16 only where
        # the CPU computes it and it agrees with fp32), not always in fp32
        (teacher,) = json.loads(client.get_run(distill_id).data.tags["teachers"])
        assert teacher["precision"] in ("fp32", "bf16")
        assert teacher["precision"] == "fp32" or teacher["serving_bf16_agreement"] >= 0.995
        # the transfer set: a folder of its own (augmented copies and parts in train, the same val and test), under the distill run
        (student_data,) = client.search_runs([distilled_eval.info.experiment_id],
                                             f"tags.mlflow.parentRunId = '{distill_id}' and tags.`zhflow.stage` = 'preprocess_transfer'")
        assert student_data.data.tags["prepared_dir"] != summary["prepared_data"]
        n = json.loads((Path(summary["prepared_data"]) / "manifest.json").read_text())["splits"]["train"]["n"]
        spans = student_data.data.metrics["count_spans_added"]  # at most one part of each train text
        assert n // 2 < spans <= n
        assert n + 3 + spans < student_data.data.metrics["train_texts"] <= 2 * n + 3 + spans  # a copy identical to its text is not added
        assert student_data.data.metrics["count_unlabelled_added"] == 3
        assert torch.load(checkpoint, weights_only=True)["model_config"]["name"] == "textcnn"
        # registered as it would be if it wins: a pyfunc of the student, with jieba (it reads words), no transformers
        from tasks.register import _requirements
        from training.presets import preset

        reqs = _requirements(preset("tiny", "pretrained"), {"kind": "neural", "model": {"name": "textcnn", "input": "word"}})
        assert any(r.startswith("jieba==") for r in reqs) and not any(r.startswith("transformers==") for r in reqs)
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_a_sweep_searches_the_distillation_settings_and_registers_the_student(prefect_server, mlflow_store, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.cli import main as zhflow

    data = write_csv(tmp_path / "reviews.csv", sentiment_rows(40))
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"distill.temperature": {"choices": [1.0, 4.0]}, "distill.alpha": {"low": 0.3, "high": 0.9}}))
    out = tmp_path / "sweep.json"
    assert zhflow(["sweep", *TINY, "--dataset", str(data), "--distill", "baseline", "--set", "distill.student.embed_dim=16",
                   "--trials", "2", "--space", str(space), "--pruner", "none", "--experiment", "swd", "--json-out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["counts"]["complete"] == 2
    client = MlflowClient()
    trials = client.search_runs([client.get_experiment_by_name("swd").experiment_id], "tags.`zhflow.stage` = 'trial'")
    for t in trials:
        students = client.search_runs([t.info.experiment_id], f"tags.mlflow.parentRunId = '{t.info.run_id}' "
                                                              "and tags.`zhflow.stage` = 'train_student'")
        assert len(students) == 1 and students[0].data.params["distill.temperature"] == t.data.params["distill.temperature"]
        assert t.data.metrics["best_val_macro_f1"] == students[0].data.metrics["best_val_macro_f1"]  # the student is scored
    version = client.get_model_version(summary["model"]["name"], summary["model"]["version"])
    model = client.get_run(version.run_id)
    assert model.data.tags["candidate"] == "neural"


def test_a_pretrained_student_needs_the_runs_tokenizer(tiny_bert, tiny_roberta_pad_last):
    from training.config import ModelConfig
    from training.models import check_student

    bert = ModelConfig(name="pretrained", pretrained=str(tiny_bert))
    check_student(bert, bert)  # the same tokenizer: its ids are in the prepared folder
    check_student(ModelConfig(), bert)  # a from-scratch student reads zhflow's vocabularies, always there
    for model in (ModelConfig(), ModelConfig(name="pretrained", pretrained=str(tiny_roberta_pad_last))):
        with pytest.raises(ConfigError, match="distill.student.pretrained: .* tokenizes with other ids than model.pretrained"):
            check_student(bert, model)


def test_unlabelled_texts_join_the_transfer_set_without_any_text_of_the_labelled_data(reviews, tmp_path):
    cfg = apply_overrides(tiny(), [f"data.dataset={reviews}", "data.max_samples=null"])
    plain = prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "plain")
    test_text = pd.read_json(tmp_path / "plain" / "test.jsonl", lines=True, dtype=False)["text"][0]
    new = ["这家店的咖啡香浓可口", "物流慢得让人生气", "这家店的咖啡香浓可口", "   ", "屏幕清晰，续航一般"]
    file = tmp_path / "unlabelled.txt"
    file.write_text("\n".join(new + [test_text, "  " + test_text]), encoding="utf-8")
    manifest = prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "transfer", unlabelled=str(file))
    c = manifest["counts"]
    assert (c["unlabelled_added"], c["unlabelled_repeats_dropped"], c["unlabelled_in_labelled_data_dropped"]) == (3, 1, 2)
    labels = np.load(tmp_path / "transfer" / "train.labels.npy")
    assert (labels == -1).sum() == 3 and len(labels) == plain["splits"]["train"]["n"] + 3
    assert manifest["splits"]["train"]["per_label"] == plain["splits"]["train"]["per_label"]  # counts labelled texts only
    for split in ("val", "test"):  # the same splits, byte for byte
        assert (tmp_path / "transfer" / f"{split}.jsonl").read_bytes() == (tmp_path / "plain" / f"{split}.jsonl").read_bytes()
    # the teachers read them as texts; the baseline teacher's cross-fitting uses the labelled ones only
    texts = transfer_texts(tmp_path / "transfer")
    assert set(texts["text"].iloc[-3:]) == {"这家店的咖啡香浓可口", "物流慢得让人生气", "屏幕清晰，续航一般"}
    probs, info, _ = baseline_teacher(tmp_path / "transfer", labels, 2, folds=3)
    assert probs.shape == (len(labels), 2) and np.allclose(probs.sum(1), 1, atol=1e-5)
    file.write_text(test_text + "\n", encoding="utf-8")
    with pytest.raises(Exception, match="none of its 1 texts is left"):
        prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "none", unlabelled=str(file))


def test_word_spans_of_train_texts_join_the_transfer_set_unlabelled(reviews, tmp_path):
    cfg = apply_overrides(tiny(), [f"data.dataset={reviews}", "data.max_samples=null"])
    plain = prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "plain")
    manifest = prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "spans", spans=2)
    added = manifest["counts"]["spans_added"]
    n_train = plain["splits"]["train"]["n"]
    labels = np.load(tmp_path / "spans" / "train.labels.npy")
    assert added > n_train // 2 and len(labels) == n_train + added and (labels[n_train:] == -1).all()
    assert manifest["splits"]["train"]["per_label"] == plain["splits"]["train"]["per_label"]
    for split in ("val", "test"):  # the same splits, byte for byte
        assert (tmp_path / "spans" / f"{split}.jsonl").read_bytes() == (tmp_path / "plain" / f"{split}.jsonl").read_bytes()
    train = transfer_texts(tmp_path / "plain")["clean"].str.replace(" ", "").tolist()  # the parts are cut from every word
    spans = transfer_texts(tmp_path / "spans")["text"].iloc[n_train:].tolist()
    held_out = [t for s in ("val", "test") for t in transfer_texts(tmp_path / "plain", s)["clean"].str.replace(" ", "")]
    for span in spans[:200]:  # a part of a train text, and no whole text of any split
        assert any(span in t for t in train) and span not in train and span not in held_out
    probs, _, _ = baseline_teacher(tmp_path / "spans", labels, 2, folds=3)  # the spans' probabilities come from the full fit
    assert probs.shape == (len(labels), 2) and np.allclose(probs.sum(1), 1, atol=1e-5)
