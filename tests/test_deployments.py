from deployments.serve import nightly_retrain


def test_nightly_retrain_form_is_described():
    """The Prefect UI draws the run form from this schema: sections and fields carry titles and help."""
    deployment = nightly_retrain()
    schema = deployment._parameter_openapi_schema.model_dump()
    assert set(schema["properties"]) == {"config", "experiment"}
    defs = schema["definitions"]
    for section in ("DataConfig", "TrainConfig", "PruneConfig"):
        for name, field in defs[section]["properties"].items():
            assert field.get("title") and field.get("description"), f"{section}.{name}"
    family = defs["ModelConfig"]["properties"]["name"]
    assert family["enum"] == ["textcnn", "bilstm", "transformer"]  # a choice, not free text
    assert deployment.schedules[0].schedule.cron == "0 2 * * *"
    assert deployment.parameters["config"]["train"]["epochs"] == 5
