"""The deployments as users meet them: the Prefect UI's run form (parameter schema), the schedules, the
missed-runs policy against a real (ephemeral) Prefect server."""

from datetime import datetime, timedelta, timezone

import pytest

from deployments.definitions import deployments, evaluate_champion, nightly_retrain, pretrain_encoder, weekly_sweep
from training.config import BUILTIN_DATASETS, PRUNE_METHODS


def _schema(deployment) -> dict:
    return deployment._parameter_openapi_schema.model_dump()


def _fields(schema: dict):
    """Every form field: (where, field schema), top-level parameters and each settings section's fields."""
    for name, field in schema["properties"].items():
        yield name, field
    for section, definition in schema.get("definitions", {}).items():
        for name, field in definition.get("properties", {}).items():
            yield f"{section}.{name}", field


def _options(field: dict) -> list[dict]:
    return field.get("anyOf", [field])


def _enum(field: dict) -> list:
    return next((o["enum"] for o in _options(field) if "enum" in o), [])


@pytest.mark.parametrize("deployment", deployments(), ids=lambda d: d.name)
def test_every_form_field_has_a_title_a_description_and_bounds(deployment):
    schema = _schema(deployment)
    for where, field in _fields(schema):
        if "$ref" in field or "allOf" in field:  # a settings section: its own fields are checked below
            continue
        assert field.get("title") and field["title"] != where.split(".")[-1], f"{deployment.name}: {where} has no title"
        assert len(field.get("description", "")) > 15, f"{deployment.name}: {where} has no description"
        for option in _options(field):
            if option.get("type") in ("integer", "number"):
                assert {"minimum", "exclusiveMinimum"} & set(option), f"{deployment.name}: {where} has no lower bound"
                assert {"maximum", "exclusiveMaximum"} & set(option), f"{deployment.name}: {where} has no upper bound"


def _deployed(name: str) -> dict:
    """The parameter schema of a deployment as `zhflow deploy` / `zhflow serve` make it (titles, empty settings)."""
    return _schema(next(d for d in deployments() if d.name == name))


def test_choices_are_enums():
    retrain = _deployed("nightly-retrain")
    defs = retrain["definitions"]
    assert _enum(retrain["properties"]["preset"]) == ["tiny", "default", "gpu", "finetune"]
    assert _enum(defs["DataConfig"]["properties"]["dataset"]) == list(BUILTIN_DATASETS)
    assert {"type": "string", "minLength": 1} .items() <= _options(defs["DataConfig"]["properties"]["dataset"])[1].items()
    assert _enum(defs["ModelConfig"]["properties"]["name"]) == ["textcnn", "bilstm", "transformer", "fasttext", "pretrained"]
    assert "save_pretrained" in defs["ModelConfig"]["properties"]["pretrained"]["description"]  # the form explains it
    assert _enum(defs["PruneConfig"]["properties"]["method"]) == list(PRUNE_METHODS)
    candidates = defs["SelectConfig"]["properties"]["candidates"]
    assert candidates["items"]["enum"] == ["neural", "linear", "ensemble"]
    # the settings start empty, so that the form sends only what a person typed; the preset fills the rest
    assert "default" not in candidates and '(default preset: ["neural", "linear", "ensemble"])' in candidates["description"]
    assert '(default preset: "both")' in defs["ModelConfig"]["properties"]["input"]["description"]
    nproc = defs["TrainConfig"]["properties"]["nproc"]["description"]  # unset by default: one "Empty:", the form's
    assert nproc.count("Empty:") == 1 and "Unset: the number of GPUs" in nproc and nproc.endswith("leaves it unset).")
    sweep = _deployed("weekly-sweep")
    assert "SelectConfig" in sweep["definitions"]  # a sweep's final choice uses the same candidates
    assert _enum(sweep["properties"]["sampler"]) == ["tpe", "random", "grid"]
    assert _enum(sweep["properties"]["pruner"]) == ["median", "successive_halving", "none"]
    assert sweep["properties"]["trials"]["minimum"] == 1
    evaluate = _schema(evaluate_champion())
    assert _enum(evaluate["properties"]["dataset"]) == list(BUILTIN_DATASETS)
    assert set(evaluate["required"]) == {"model_uri", "dataset"}
    pretrain = _deployed("pretrain-encoder")
    assert set(pretrain["required"]) == {"config"} and not pretrain_encoder().schedules
    encoder = pretrain["definitions"]["EncoderConfig"]["properties"]
    assert _enum(encoder["masking"]) == ["wwm", "char"] and encoder["size"]["default"] == "small"
    assert _enum(pretrain["definitions"]["TrainConfig"]["properties"]["strategy"]) == ["ddp", "fsdp"]
    assert "validation and test texts are removed" in pretrain["definitions"]["CorpusConfig"]["properties"]["exclude_prepared"]["description"]


def test_schedules_and_defaults():
    retrain, sweep, evaluate = nightly_retrain(), weekly_sweep(), evaluate_champion()
    assert (retrain.schedules[0].schedule.cron, retrain.schedules[0].schedule.timezone) == ("0 2 * * *", "Asia/Shanghai")
    assert sweep.schedules[0].schedule.cron == "0 3 * * 6"
    assert not evaluate.schedules
    assert retrain.parameters == {"preset": "default", "experiment": "zhflow-nightly"}
    assert evaluate.parameters["model_uri"] == "models:/zhflow-snownlp-sentiment@champion"
    assert retrain.concurrency_limit == sweep.concurrency_limit == 1


def test_missed_runs_policy_keeps_only_the_newest(prefect_server):
    """A night without a worker leaves several due runs; whichever starts first, only the newest runs."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId

    from tasks.schedule import settle_missed_runs, slot_key

    deployment_id = nightly_retrain().apply()
    now = datetime.now(timezone.utc)
    with get_client(sync_client=True) as client:
        # what the scheduler made while nobody ran them: the last three nights (the API's backfill)
        client._client.post(f"/deployments/{deployment_id}/schedule", json={
            "start_time": (now - timedelta(days=3, hours=1)).isoformat(), "end_time": now.isoformat(), "max_runs": 10})
        manual = client.create_flow_run_from_deployment(deployment_id)
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id])))
        due = sorted([r for r in runs if r.auto_scheduled and r.expected_start_time <= now], key=lambda r: r.expected_start_time)
        assert len(due) >= 3 and slot_key(manual) is None and all(slot_key(r) for r in due)

        superseded, cancelled = settle_missed_runs(client, due[0], now)  # the worker starts the oldest first
        assert superseded and {r.id for r in cancelled} == {r.id for r in due[1:-1]}
        superseded, cancelled = settle_missed_runs(client, due[-1], now)  # the newest then runs, and finds the oldest
        assert not superseded and [r.id for r in cancelled] == [due[0].id]
        states = {r.id: r.state for r in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id])))}
        assert all(states[r.id].is_cancelled() and due[-1].name in states[r.id].message for r in due[:-1])
        assert states[due[-1].id].is_scheduled() and states[manual.id].is_scheduled()  # a run started by hand is left alone
        assert settle_missed_runs(client, manual, now) == (False, [])


def test_server_refuses_an_unreachable_database_clearly(tmp_path, capsys):
    from deployments.cli import main

    code = main(["server", "--mlflow-db", "postgresql://zhflow:secret@127.0.0.1:1/zhflow_mlflow", "--logs", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and "cannot reach PostgreSQL at postgresql://zhflow:***@127.0.0.1:1/postgres" in err
    assert "secret" not in err


def test_deploy_and_serve_need_a_prefect_server(monkeypatch, capsys):
    from deployments.cli import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    for command in ("deploy", "serve"):
        assert main([command]) == 2
        assert "PREFECT_API_URL is not set" in capsys.readouterr().err


def test_deploy_keeps_passwords_out_of_the_deployment(monkeypatch, tmp_path):
    from deployments.deploy import job_variables

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("ZHFLOW_OPTUNA_STORAGE", "postgresql://zhflow@db:5432/optuna")  # a user, no password: fine
    variables = job_variables(tmp_path)
    assert variables["working_dir"] == str(tmp_path.resolve())
    assert variables["env"]["ZHFLOW_OPTUNA_STORAGE"] == "postgresql://zhflow@db:5432/optuna"
    monkeypatch.setenv("ZHFLOW_OPTUNA_STORAGE", "postgresql://zhflow:secret@db:5432/optuna")
    with pytest.raises(ValueError, match="ZHFLOW_OPTUNA_STORAGE holds a password") as err:
        job_variables(tmp_path)
    assert "secret" not in str(err.value)
