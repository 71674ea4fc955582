import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import sentiment_rows, write_csv

ZHFLOW = str(Path(sys.executable).with_name("zhflow"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "train.lrr=1"], "unknown field 'train.lrr'"),
        (["--set", "train.lr=abc"], "train.lr"),
        (["--nproc", "0"], "train.nproc"),
        (["--model", "gpt"], "model.name"),
        (["--set", "prune.amount=1.5"], "prune.amount"),
        # checks across settings: the message names the setting, without pydantic's prefix or the whole config
        (["--distill", "trained", "--set", "select.candidates=linear"], "error: distill.teacher: 'trained' is the run's neural model"),
        (["--set", "train.strategy=fsdp"], "error: train.strategy: fsdp shards"),
        (["--model", "textcnn", "--pretrained", "some/model"], "--pretrained fine-tunes a pretrained checkpoint"),
        (["--set", "data.val_ratio=0.49", "--set", "data.test_ratio=0.49"], "error: data: val_ratio + test_ratio must leave"),
        # a missing auxiliary file or a name the registry refuses: before training, not after it
        (["--set", "preprocess.user_dict=nope.txt"], "error: preprocess.user_dict: no such file: nope.txt"),
        (["--distill", "baseline", "--set", "distill.unlabelled=extra.txt"], "error: distill.unlabelled: no such file: extra.txt"),
        (["--set", "registry.model_name=team/model"], "error: registry.model_name: a registered model's name may not contain '/'"),
        (["--test-dataset", "nope.csv"], "error: data.test_dataset: dataset 'nope.csv' is neither"),
        pytest.param(["--set", "train.precision=fp16"], "error: train.precision: fp16 needs a CUDA device",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is accepted where CUDA is")),
    ],
)
def test_bad_settings_fail_before_any_work(args, message, tmp_path):
    out = subprocess.run([ZHFLOW, "run", "--preset", "tiny", *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and "Value error" not in out.stderr and "{'data'" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / ".zhflow").exists()  # nothing started


def test_zhflow_distill_refuses_the_teacher_only_zhflow_run_trains(tmp_path):
    out = subprocess.run([ZHFLOW, "distill", "--preset", "tiny", "--teacher", "trained"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "error: distill.teacher: 'trained' is the model `zhflow run --distill trained`" in out.stderr
    assert "select.candidates" not in out.stderr  # advice for zhflow run does not fit this command
    assert not (tmp_path / "mlflow.db").exists()


TWO_CLASSES = "text,label\n" + "".join(f"{t},positive\n" for t in ("很好看", "不错啊", "值得买", "挺喜欢")) + "".join(
    f"{t},negative\n" for t in ("太差了", "不好用", "很失望", "退货了"))


@pytest.mark.parametrize(
    "make_file, message",
    [
        (lambda p: None, "is neither a built-in corpus"),
        (lambda p: p.write_text("review,label\n好看,positive\n很差,negative\n", encoding="utf-8"), "no column 'text'"),
        (lambda p: p.write_text("text,label\n好看,positive\n不错,positive\n", encoding="utf-8"), "only one class"),
        (lambda p: p.write_text(TWO_CLASSES + "还行吧,中性\n一般般,中性\n", encoding="utf-8"),
         "classes too small to appear in every split (need 3 texts each): '中性' has 2"),
        # every 中性 row empty once cleaned, or the text of a row of another label: the class is gone, not dropped quietly
        (lambda p: p.write_text(TWO_CLASSES + "\u200b\u200b,中性\n   ,中性\n很好看,中性\n", encoding="utf-8"),
         "no text of class '中性' is left after cleaning and deduplication"),
    ],
)
def test_bad_dataset_fails_before_prefect_or_mlflow_start(make_file, message, tmp_path):
    path = tmp_path / "data.csv"
    make_file(path)
    out = subprocess.run([ZHFLOW, "run", "--preset", "tiny", "--dataset", str(path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and message in out.stderr
    assert "Traceback" not in out.stderr and "temporary server" not in out.stderr + out.stdout
    assert not (tmp_path / "mlflow.db").exists()  # no FAILED runs left behind


def test_help_lists_the_options():
    out = subprocess.run([ZHFLOW, "run", "--help"], capture_output=True, text=True, timeout=60)
    for option in ("--dataset", "--preset", "--model", "--nproc", "--experiment", "--set", "--json-out"):
        assert option in out.stdout


PREFECT_IMPORT_PROBE = """
import importlib.abc, os, sys
seen = []
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "prefect" and not seen:
            seen.append(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"))
        return None
sys.meta_path.insert(0, Probe())
from deployments.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("prefect imported with", seen)
"""


@pytest.mark.parametrize("args", [["run", "--dataset", "r.csv"], ["pretrain", "--corpus", "c.txt"],
                                  ["sweep", "--dataset", "r.csv"]])
def test_the_temporary_prefect_server_gets_its_start_time_before_prefect_reads_its_settings(args, tmp_path):
    # Prefect reads its settings once, at its first import: a variable set after it is never seen (the temporary
    # server then gets 20 s to start, which a busy 2-core machine misses). Valid settings reach the server check,
    # which imports Prefect; an MLflow server that does not answer ends the command there.
    write_csv(tmp_path / "r.csv", sentiment_rows(10))
    (tmp_path / "c.txt").write_text("".join(f"{text}\n" for text, _ in sentiment_rows(10)), encoding="utf-8")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("PREFECT_SERVER_EPHEMERAL")}
    done = subprocess.run([sys.executable, "-c", PREFECT_IMPORT_PROBE, *args], cwd=tmp_path, capture_output=True, text=True,
                          env=env | {"PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                                     "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}, timeout=120)
    assert "prefect imported with ['120']" in done.stdout, done.stdout + done.stderr
    assert "MLflow tracking server" in done.stderr and "127.0.0.1:9" in done.stderr, done.stderr


def test_a_typo_in_a_setting_is_answered_before_mlflow_and_prefect_load(tmp_path):
    """Settings, the user's files and the dataset are checked before the seconds MLflow and Prefect take to import."""
    probe = ("import sys\nfrom deployments.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('mlflow', 'prefect', 'torch') if m in sys.modules))")
    for args in (["run", "--preset", "tiny", "--set", "train.lrr=1"], ["run", "--dataset", "missing.csv"],
                 ["sweep", "--preset", "tiny", "--study", "a/b"]):
        done = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, capture_output=True, text=True,
                              env=__import__("os").environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                              timeout=120)
        assert "zhflow: error:" in done.stderr and done.stdout.strip().endswith("[]"), (args, done.stdout, done.stderr)


@pytest.mark.parametrize("command", ["run", "distill"])
def test_student_flag_gives_the_family_with_its_preset_defaults(command):
    from flows.cli import build_config, build_parser
    from training.presets import preset

    parser, _ = build_parser()
    args = parser.parse_args([command, "--preset", "tiny", "--teacher" if command == "distill" else "--distill", "baseline",
                              "--student", "bilstm", "--set", "distill.student.dropout=0.2"])
    config = build_config(args)
    taught = preset("tiny", "bilstm")
    assert config.distill.student == taught.model.model_copy(update={"dropout": 0.2})
    assert config.distill.train == taught.train
    assert config.model.name == preset("tiny").model.name  # the run's own model keeps the preset's family


def test_the_summary_says_what_a_user_would_otherwise_miss(capsys):
    """A tie on validation, a teacher that made the student worse, classes never predicted: each a line of the run's
    summary (a hand-built summary of the shape train_pipeline returns)."""
    from flows.cli import _print_summary

    scores = {"val_macro_f1": 0.4643, "test_macro_f1": 0.5, "test_accuracy": 0.5}
    metrics = {"test_accuracy": 0.5, "test_macro_f1": 0.5, "test_macro_precision": 0.5, "test_macro_recall": 0.5,
               "baseline_test_macro_f1": 0.6, "baseline_test_accuracy": 0.6, "test_classes_never_predicted": 1.0,
               "distill_teacher_test_macro_f1": 0.74, "distill_alone_test_macro_f1": 0.67,
               "distill_distilled_test_macro_f1": 0.63, "distill_alone_val_macro_f1": 0.7, "distill_distilled_val_macro_f1": 0.65}
    summary = {"experiment": "e", "parent_run_id": "p", "stage_runs": {}, "metrics": metrics, "selected": "neural",
               "candidates": {"neural": scores, "linear": scores | {"test_macro_f1": 0.6}, "ensemble": scores | {"val_macro_f1": 0.3}},
               "training": None, "prepared_data": "/tmp/x",
               "model": {"uri": "models:/m/1", "kind": "neural", "alias": "champion", "reason": "first model"}}
    _print_summary(summary, "distill")
    out = " ".join(capsys.readouterr().out.split())
    assert "zhflow distill" in out
    assert "note: neural, linear tie on validation macro-F1; the first of them is registered" in out
    assert "1 of the test split's classes: the registered model predicts none" in out
    assert "the teacher made the student worse on validation" in out.replace("│ ", "").replace(" │", "")
