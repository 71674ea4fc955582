"""The pretrained family on tiny encoders built here (no hub): the model's own tokenizer in preprocessing, a pad id
other than 0, checkpoints that rebuild without the original folder, serving with the tokenizer inside, the offline
error, and a whole run under torchrun with 2 processes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import sentiment_rows, write_csv
from training.data.prepare import prepare_dataset
from training.evaluate import open_split, predict_proba
from training.models import family
from training.presets import preset

ROOT = Path(__file__).resolve().parents[1]


def _config(source: Path, dataset: Path, max_len: int = 24):
    cfg = preset("tiny", "pretrained")
    return cfg.model_copy(update={
        "data": cfg.data.model_copy(update={"dataset": str(dataset), "max_samples": None}),
        "preprocess": cfg.preprocess.model_copy(update={"max_len": max_len}),
        "model": cfg.model.model_copy(update={"pretrained": str(source)}),
    })


def _built(source: Path, reviews: Path, tmp_path: Path, max_len: int = 24):
    """Settings, prepared folder (with the tokenizer's ids), family, sizes and a fresh model (seed 0) for ``source``."""
    cfg = _config(source, reviews, max_len)
    manifest = prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "p", tokenizer=str(source))
    fam = family("pretrained")
    sizes = fam.sizes(manifest, cfg.model, max_len)
    torch.manual_seed(0)
    return cfg, manifest, fam, sizes, fam.build(cfg.model, sizes, 2).eval()


@pytest.fixture(scope="module")
def reviews(tmp_path_factory) -> Path:
    return write_csv(tmp_path_factory.mktemp("data") / "reviews.csv", sentiment_rows(40))


def test_preprocessing_stores_the_tokenizers_ids_with_its_pad_id_and_counts_cut_texts(tiny_roberta_pad_last, reviews, tmp_path):
    cfg = _config(tiny_roberta_pad_last, reviews, max_len=12)
    manifest = prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "p", tokenizer=str(tiny_roberta_pad_last))
    tok = manifest["tokenizer"]
    assert tok["pad_id"] == tok["vocab_size"] - 1 != 0  # the pad token at the last id, read from the tokenizer
    assert tok["max_len"] == 12 and tok["truncated"]["train"] == manifest["splits"]["train"]["n"]  # all longer than 12
    ids = np.load(tmp_path / "p" / "train.tokens_ids.npy")
    offsets = np.load(tmp_path / "p" / "train.tokens_offsets.npy")
    assert (np.diff(offsets) == 12).all()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "p" / "tokenizer")  # saved beside the ids
    first = ids[offsets[0]:offsets[1]].tolist()
    assert first[0] == tokenizer.cls_token_id and first[-1] == tokenizer.sep_token_id  # cut, the end token kept

    fam = family("pretrained")
    sizes = fam.sizes(manifest, cfg.model, 12)
    split = open_split(tmp_path / "p", "val", cfg.model, 12, sizes)
    short = ({"tokens": torch.tensor([tokenizer.cls_token_id, 5, tokenizer.sep_token_id])}, 0)
    batch, labels = split.collate([split[0], short])
    assert batch["input_ids"][1, 3:].eq(tok["pad_id"]).all() and batch["attention_mask"][1].tolist() == [1] * 3 + [0] * 9


def test_two_tokenizers_never_share_a_prepared_folder(tiny_bert, tiny_roberta_pad_last, reviews):
    from tasks.preprocess import preprocess_key

    cfg = _config(tiny_bert, reviews)
    keys = {preprocess_key(cfg.data, cfg.preprocess, cfg.augment, t) for t in (None, str(tiny_bert), str(tiny_roberta_pad_last))}
    assert len(keys) == 3


@pytest.mark.parametrize("fixture", ["tiny_bert", "tiny_roberta_pad_last"])
def test_a_checkpoint_rebuilds_without_the_original_folder_and_padding_changes_nothing(fixture, request, reviews, tmp_path):
    cfg, manifest, fam, sizes, model = _built(request.getfixturevalue(fixture), reviews, tmp_path)
    state = {"sizes": sizes, "model": model.state_dict()}
    rebuilt = fam.build(cfg.model, fam.checkpoint_sizes(state), 2).eval()  # from the config it carries: no from_pretrained
    rebuilt.load_state_dict(state["model"])
    split = open_split(tmp_path / "p", "test", cfg.model, 24, sizes)
    assert np.allclose(predict_proba(model, split, 4), predict_proba(rebuilt, split, 4), atol=1e-6)
    one = [split[0]]
    padded = [split[0], ({"tokens": split[0][0]["tokens"][:3]}, 0)]  # a shorter text in the batch: more padding
    alone = model(split.collate(one)[0])
    together = model(split.collate(padded)[0])[:1]
    assert torch.allclose(alone, together, atol=1e-5)


def _zhflow(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("zhflow")), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "ZHFLOW_HOME": str(cwd / "home"), **(env or {})})


@pytest.mark.parametrize("network", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["offline", "hub-unreachable"])
def test_a_hub_id_that_cannot_be_fetched_is_one_clear_line_and_nothing_is_recorded(tmp_path, network):
    """Answered before the servers are asked (an unreachable tracking server would otherwise be the error) and before
    anything is recorded."""
    started = time.monotonic()
    out = _zhflow(["run", "--preset", "tiny", "--pretrained", "hfl/not-a-cached-model"], tmp_path,
                  env={**network, "HF_HOME": str(tmp_path / "hf"), "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zhflow: error: model.pretrained: 'hfl/not-a-cached-model'"), out.stderr
    assert "HF_HOME" in lines[0] and "local folder" in lines[0] and "Traceback" not in out.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "home").exists()  # no run, no prepared data
    missing = _zhflow(["run", "--preset", "tiny", "--pretrained", str(tmp_path / "nope")], tmp_path)
    assert missing.returncode == 2 and "no such folder" in missing.stderr


def test_a_hub_id_in_the_cache_passes_the_check_offline(tmp_path, monkeypatch):
    """The check reads the Hugging Face cache as huggingface_hub lays it out: a model downloaded before (or a cache
    copied from a connected machine) is accepted with HF_HUB_OFFLINE set; an invalid id is one clear error."""
    from training.models.hub import PretrainedError, check_source

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(PretrainedError, match="'org/model' is not a local folder and not in the Hugging Face cache"):
        check_source("org/model")
    repo = tmp_path / "hub" / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    check_source("org/model")
    with pytest.raises(PretrainedError, match="model.pretrained: 'a b/c d'"):
        check_source("a b/c d")


def test_a_folder_that_is_not_a_whole_checkpoint_is_refused_naming_what_it_lacks(tiny_bert, tmp_path):
    """A local folder is never sent to the hub; without a tokenizer vocabulary, AutoTokenizer would build one of
    special tokens only and every text would train as [UNK]."""
    import shutil

    no_tokenizer, no_config, no_weights = tmp_path / "no-tokenizer", tmp_path / "no-config", tmp_path / "no-weights"
    no_tokenizer.mkdir(), no_config.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_bert / name, no_tokenizer / name)
    (no_config / "readme.txt").write_text("hello")
    shutil.copytree(tiny_bert, no_weights, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    for folder, lacks in ((no_tokenizer, "no tokenizer vocabulary"), (no_config, "no config.json"),
                          (no_weights, "no weights (none of model.safetensors")):
        out = _zhflow(["run", "--preset", "tiny", "--pretrained", str(folder)], tmp_path)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"model.pretrained: '{folder}' is a folder but not a checkpoint" in out.stderr and lacks in out.stderr
        assert "hf download" not in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_fine_tuning_a_local_checkpoint_with_two_processes_registers_and_serves(tiny_bert, reviews, tmp_path, prefect_api):
    """`zhflow run --pretrained FOLDER` end to end: 2 DDP processes on gloo, evaluation, registration; the served model
    carries the tokenizer (no jieba needed for it) and predicts what the model predicts in-process."""
    out = tmp_path / "summary.json"
    run = _zhflow(["run", "--preset", "tiny", "--pretrained", str(tiny_bert), "--dataset", str(reviews), "--nproc", "2",
                   "--set", "data.max_samples=null", "--set", "train.lr=2e-3", "--set", "train.epochs=20", "--set", "train.batch_size=8",
                   "--set", "train.patience=20", "--set", "train.schedule=constant", "--set", "prune.amount=0.5", "--set", "prune.method=structured",
                   "--set", "prune.finetune_epochs=3", "--set", "prune.finetune_lr=2e-3", "--set", "preprocess.max_len=24", "--set", "select.candidates=neural",
                   "--json-out", str(out)], tmp_path, env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                           "PREFECT_API_URL": prefect_api}, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["selected"] == "neural"
    assert summary["metrics"]["test_macro_f1"] > 0.8  # templated reviews: a model that learned nothing scores ~0.33-0.5

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        model = mlflow.pyfunc.load_model(summary["model"]["uri"])
        texts = ["这本书非常好看，值得一读", "质量太差了，很失望"]
        served = model.predict(texts)
        assert served["label"].tolist() == ["positive", "negative"]
        classifier = model.unwrap_python_model()
        assert classifier.encoder.__class__.__name__ == "TokenizerEncoder"
        requirements = Path(mlflow.pyfunc.get_model_dependencies(summary["model"]["uri"])).read_text()
        assert "transformers==" in requirements and "jieba" not in requirements  # its tokenizer only
        direct = classifier.predict_proba(texts)
        assert np.allclose(served[["prob_negative", "prob_positive"]].to_numpy(), direct, atol=1e-6)

        # the trained model as a save_pretrained folder: transformers loads it outside zhflow, with the label names
        from mlflow.tracking import MlflowClient
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        client = MlflowClient()
        parent = client.get_run(summary["parent_run_id"])
        (train,) = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                                                    "and tags.`zhflow.stage` = 'train'")
        folder = Path(mlflow.artifacts.download_artifacts(run_id=train.info.run_id, artifact_path="export", dst_path=str(tmp_path)))
        assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
        hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert hf.config.id2label == {0: "negative", 1: "positive"}
        assert tokenizer.model_max_length == hf.config.max_position_embeddings  # truncation=True fits the model
        assert tokenizer("好" * 500, truncation=True, return_tensors="pt")["input_ids"].shape[1] == tokenizer.model_max_length
        with torch.no_grad():
            logits = hf(**tokenizer(["这本书非常好看，值得一读"], return_tensors="pt")).logits
        assert hf.config.id2label[int(logits.argmax())] == "positive"
    finally:
        mlflow.set_tracking_uri(None)

    # zhflow predict, zhflow evaluate and `mlflow models serve` on the registered (pruned) model
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PREFECT_API_URL": prefect_api}
    uri = f"models:/{summary['model']['name']}@champion"
    predicted = _zhflow(["predict", "--model-uri", uri, "这本书非常好看，值得一读", "--json-out", str(tmp_path / "p.jsonl")], tmp_path, env)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert json.loads((tmp_path / "p.jsonl").read_text(encoding="utf-8").splitlines()[0])["label"] == "positive"
    evaluated = _zhflow(["evaluate", "--model-uri", uri, "--dataset", str(reviews), "--json-out", str(tmp_path / "e.json")],
                        tmp_path, env)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "e.json").read_text())["metrics"]["test_macro_f1"] > 0.8
    from tests.test_sweep import _serve_and_post

    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
    try:
        _serve_and_post(uri, tmp_path)
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI")


def test_precision_settings_and_gradient_checkpointing(tiny_bert, reviews, tmp_path):
    from training.config import ConfigError
    from training.evaluate import autocast_dtype
    from training.models import build_model

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("auto", cuda) == torch.bfloat16
    assert autocast_dtype("bf16", cpu) == torch.bfloat16 and autocast_dtype("fp32", cuda) is None
    with pytest.raises(ConfigError, match="train.precision: fp16 needs a CUDA device"):
        autocast_dtype("fp16", cpu)

    cfg, _, fam, _, model = _built(tiny_bert, reviews, tmp_path)
    fam.enable_gradient_checkpointing(model, cfg.model)
    assert model.model.is_activation_checkpointing

    # the scratch transformer: the same loss and gradients with and without checkpointing
    small = preset("tiny", "transformer").model.model_copy(update={"dropout": 0.0})
    torch.manual_seed(0)
    plain = build_model(small, 40, 2)
    checked = build_model(small, 40, 2)
    checked.load_state_dict(plain.state_dict())
    family("transformer").enable_gradient_checkpointing(checked, small)
    batch = {"word": torch.randint(1, 40, (3, 7))}
    for m in (plain, checked):
        m.train()
        torch.nn.functional.cross_entropy(m(batch), torch.tensor([0, 1, 1])).backward()
    for (name, a), b in zip(plain.named_parameters(), checked.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    with pytest.raises(ConfigError, match="train.gradient_checkpointing: the textcnn family"):
        family("textcnn").enable_gradient_checkpointing(build_model(preset("tiny").model, 40, 2), preset("tiny").model)


@pytest.mark.slow
def test_two_processes_in_bf16_with_gradient_checkpointing_resume_after_a_killed_rank(tiny_roberta_pad_last, reviews, tmp_path):
    """RoBERTa (pad id not 0) under torchrun: bf16 autocast on CPU, gradient checkpointing, rank 1 killed mid-epoch 2;
    the group restarts, resumes from epoch 1 and still learns the task."""
    from tests.test_worker_ddp import _cmd, _env, _run
    from training.checkpoint import load_checkpoint
    from training.events import read_result
    from training.job import WorkerJob

    cfg = _config(tiny_roberta_pad_last, reviews)
    prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "p", tokenizer=str(tiny_roberta_pad_last))
    train = cfg.train.model_copy(update={"epochs": 16, "patience": 16, "batch_size": 8, "lr": 2e-3, "schedule": "constant", "precision": "bf16",
                                         "gradient_checkpointing": True, "max_restarts": 1, "log_every": 1})
    job = WorkerJob(stage="train", prepared_dir=str(tmp_path / "p"), out_dir=str(tmp_path / "out"), model=cfg.model,
                    train=train, max_len=24)
    out = _run(_cmd(job, tmp_path), _env(ZHFLOW_TEST_KILL_AT_STEP="6", ZHFLOW_TEST_KILL_ONCE_FILE=str(tmp_path / "killed")),
               timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "killed").exists() and "after epoch 1 (restart 1)" in out.stdout
    result = read_result(tmp_path / "out")
    assert result["world_size"] == 2 and result["restarts"] == 1 and result["epochs_run"] == 16
    assert result["best_val_macro_f1"] > 0.8
    state = load_checkpoint(result["best_checkpoint"])
    assert state["sizes"]["pad_id"] != 0 and "pretrained" in state["sizes"]  # rebuilt without the folder on load
    assert Path(result["export_dir"], "config.json").is_file()


def test_heads_and_units_pruned_away_reload_and_export_with_the_same_predictions(tiny_roberta_pad_last, reviews, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from training.prune import structured_prune

    cfg, manifest, fam, sizes, model = _built(tiny_roberta_pad_last, reviews, tmp_path)
    pruned, same_cfg = structured_prune(model, cfg.model, 0.5)
    assert same_cfg == cfg.model
    kept = fam.sizes_of(pruned, sizes)["kept"]
    assert kept == {"heads": [2, 2], "units": [32, 32]}  # 4 heads and 64 units per layer before
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert params(pruned) < params(model)
    again, _ = structured_prune(pruned, cfg.model, 0.75)  # cumulative: 75% of the original counts
    assert fam.sizes_of(again, sizes)["kept"] == {"heads": [1, 1], "units": [16, 16]}

    split = open_split(tmp_path / "p", "test", cfg.model, 24, sizes)
    batch, _ = split.collate([split[i] for i in range(6)])
    with torch.no_grad():
        expected = pruned.eval()(batch)
    # a checkpoint of the pruned model rebuilds to the same shapes, without the original folder
    state = {"sizes": fam.sizes_of(pruned, sizes), "model": pruned.state_dict()}
    rebuilt = fam.build(cfg.model, fam.checkpoint_sizes(state), 2).eval()
    rebuilt.load_state_dict(state["model"])
    with torch.no_grad():
        assert torch.allclose(rebuilt(batch), expected, atol=1e-5)
    # the save_pretrained export loads with plain transformers and predicts the same
    folder = fam.export(pruned, tmp_path / "export", tmp_path / "p", ["negative", "positive"])
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert hf.config.intermediate_size == 32
    with torch.no_grad():
        assert torch.allclose(hf(**batch).logits, expected, atol=1e-5)


def test_unstructured_pruning_reaches_the_family_model(tiny_bert, reviews, tmp_path):
    from training.prune import prune, sparsity

    cfg, _, _, _, model = _built(tiny_bert, reviews, tmp_path)
    model, _ = prune(model, cfg.model, "global_unstructured", 0.6)
    assert sparsity(model)["sparsity_prunable"] == pytest.approx(0.6, abs=0.01)


def test_the_served_model_runs_in_bf16_only_where_it_agrees_with_fp32_and_pays(tiny_bert, reviews, tmp_path, monkeypatch):
    import training.inference as inference
    from training.inference import TextClassifier, serving_precision

    cfg, manifest, fam, sizes, model = _built(tiny_bert, reviews, tmp_path)
    from training.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "best.pt", {"model": model.state_dict(), "model_config": cfg.model.model_dump(),
                                           "sizes": sizes, "num_classes": 2, "max_len": 24})
    (tmp_path / "meta.json").write_text(json.dumps({"labels": manifest["labels"], "preprocess": cfg.preprocess.model_dump(),
                                                    "kind": "neural", "weight": 1.0}))
    artifacts = {"meta": str(tmp_path / "meta.json"), "checkpoint": str(tmp_path / "best.pt"),
                 **fam.served_artifacts(tmp_path / "p")}
    classifier = TextClassifier()
    classifier.load_context(type("Ctx", (), {"artifacts": artifacts})())
    texts = [t for t, _ in sentiment_rows(20)]
    monkeypatch.setattr(inference, "cpu_has_bf16", lambda: False)
    assert serving_precision(classifier, texts) == ("fp32", {})  # emulated bf16: never
    monkeypatch.setattr(inference, "cpu_has_bf16", lambda: True)
    chosen, checked = serving_precision(classifier, texts, min_speedup=0.0)
    assert checked["serving_bf16_agreement"] >= 0.995 and chosen == "bf16" == classifier.precision
    served, _ = classifier._serving()  # bf16 weights, made once; the fp32 model stays as it was
    assert {p.dtype for p in served.parameters()} == {torch.bfloat16} and served is classifier._serving()[0]
    assert {p.dtype for p in classifier.model.parameters()} == {torch.float32}
    assert serving_precision(classifier, texts, min_speedup=1e9)[0] == "fp32"  # not faster: fp32
    assert serving_precision(classifier, texts, min_agreement=1.01, min_speedup=0.0)[0] == "fp32"  # labels differ: fp32


def test_serving_cuts_a_long_text_without_transformers_warning_of_indexing_errors(tiny_bert, tmp_path):
    """The served encoder cuts texts at the model's limit itself; transformers' warning that the text "will result in
    indexing errors" would be false, and showed in every predict and teacher's labelling."""
    import logging
    import shutil

    from training.models.pretrained import TokenizerEncoder

    folder = shutil.copytree(tiny_bert, tmp_path / "bert")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"model_max_length": 16}))

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    hf = logging.getLogger("transformers")
    hf.addHandler(handler)
    try:
        encoder = TokenizerEncoder(str(folder), 0, 16)
        tokens = encoder(["很好" * 400, "差"])["input_ids"]
    finally:
        hf.removeHandler(handler)
    assert tokens.shape == (2, 16)
    assert not [r for r in records if "indexing errors" in r.getMessage()], [r.getMessage() for r in records]
