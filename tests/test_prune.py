"""Pruning methods: structured pruning really shrinks the model (and changes nothing when it removes dead
units), unstructured pruning reaches its amount, and checkpoints store the zeros compactly."""

import os

import pytest
import torch

from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import ModelConfig, PruneConfig
from training.models import build_model
from training.prune import prune, sparsity, structured_prune

VOCAB = {"word": 60, "char": 40}
FAMILIES = ["textcnn", "bilstm", "transformer", "fasttext"]


def _cfg(name, **kw):
    base = dict(name=name, embed_dim=16, num_filters=8, kernel_sizes=[2, 3], hidden_size=8, num_heads=4, num_layers=2, dropout=0.1,
                buckets=97)
    return ModelConfig(**(base | kw))


def _inputs():
    g = torch.Generator().manual_seed(1)
    word = torch.randint(1, 60, (5, 9), generator=g)
    word[0, 4:] = 0  # a padded text
    return {"word": word, "char": torch.randint(1, 40, (5, 11), generator=g)}


def _params(model):
    return sum(p.numel() for p in model.parameters())


def _kill_units(model, cfg):
    """Zero the first half of every structured unit, so that they are exactly the ones ranked lowest."""
    with torch.no_grad():
        for enc in model.encoders.values():
            if cfg.name in ("textcnn", "bilstm", "fasttext"):
                enc.embedding.weight[:, : cfg.embed_dim // 2] = 0
            if cfg.name == "fasttext":
                enc.ngrams.weight[:, : cfg.embed_dim // 2] = 0
            elif cfg.name == "textcnn":
                for conv in enc.convs:
                    conv.weight[: cfg.num_filters // 2] = 0
                    conv.bias[: cfg.num_filters // 2] = 0
            elif cfg.name == "bilstm":
                h = cfg.hidden_size
                for name, p in enc.lstm.named_parameters():  # gates i, f, g, o stacked: rows j, h+j, 2h+j, 3h+j
                    for gate in range(4):
                        p[gate * h : gate * h + h // 2] = 0
            else:
                hd = cfg.embed_dim // cfg.num_heads
                a = cfg.num_heads * hd
                for layer in enc.layers:
                    for block in range(3):  # q, k, v rows of the first half of the heads
                        layer.qkv.weight[block * a : block * a + a // 2] = 0
                        layer.qkv.bias[block * a : block * a + a // 2] = 0
                    layer.out.weight[:, : a // 2] = 0
                    layer.ff1.weight[: layer.ff1.out_features // 2] = 0
                    layer.ff1.bias[: layer.ff1.out_features // 2] = 0
                    layer.ff2.weight[:, : layer.ff2.in_features // 2] = 0


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("inputs", ["word", "both"])
def test_structured_removes_dead_units_without_changing_outputs(name, inputs):
    torch.manual_seed(0)
    cfg = _cfg(name, input=inputs)
    model = build_model(cfg, VOCAB, 3).eval()
    _kill_units(model, cfg)
    x = _inputs()
    pruned, small = structured_prune(model, cfg, 0.5)
    assert torch.allclose(pruned(x), model(x), atol=1e-5)
    assert _params(pruned) < _params(model)
    assert not [n for n, _ in pruned.named_buffers() if n.endswith("_mask")]  # plain weights, no pruning masks
    # the smaller ModelConfig alone rebuilds it: a model of the same family with smaller layers, no masks
    rebuilt = build_model(small, VOCAB, 3).eval()
    rebuilt.load_state_dict(pruned.state_dict())
    assert torch.allclose(rebuilt(x), model(x), atol=1e-5)
    if name == "textcnn":
        assert (small.embed_dim, small.num_filters) == (8, 4)
    elif name == "bilstm":
        assert (small.embed_dim, small.hidden_size) == (8, 4)
    elif name == "fasttext":
        assert small.embed_dim == 8 and small.buckets == cfg.buckets
    else:
        assert (small.num_heads, small.head_dim, small.ffn_dim, small.embed_dim) == (2, 4, 32, 16)


@pytest.mark.parametrize("name", FAMILIES)
def test_structured_is_cumulative_against_the_original_sizes(name):
    torch.manual_seed(0)
    cfg = _cfg(name)
    model = build_model(cfg, VOCAB, 2).eval()
    once, cfg_once = structured_prune(model, cfg, 0.75)
    first, cfg1 = structured_prune(model, cfg, 0.5)
    twice, cfg2 = structured_prune(first, cfg1, 0.75, reference=cfg)
    assert cfg2 == cfg_once and _params(twice) == _params(once)
    assert torch.isfinite(twice(_inputs())).all()
    same, _ = structured_prune(model, cfg, 0.0)
    assert torch.allclose(same(_inputs()), model(_inputs()), atol=1e-6)


def test_structured_keeps_at_least_one_unit():
    cfg = _cfg("textcnn", num_filters=2)
    pruned, small = structured_prune(build_model(cfg, VOCAB, 2), cfg, 0.99)
    assert small.num_filters == 1 and small.embed_dim == 1
    assert pruned(_inputs()).shape == (5, 2)


@pytest.mark.parametrize("method", ["global_unstructured", "l1_unstructured"])
def test_unstructured_methods(method):
    torch.manual_seed(0)
    cfg = _cfg("textcnn")
    model, same_cfg = prune(build_model(cfg, VOCAB, 2), cfg, method, 0.7)
    stats = sparsity(model)
    assert same_cfg == cfg and stats["sparsity_prunable"] == pytest.approx(0.7, abs=0.01)
    per_layer = [v for k, v in stats.items() if k.startswith("sparsity.")]
    if method == "l1_unstructured":  # every layer at the amount
        assert all(v == pytest.approx(0.7, abs=0.02) for v in per_layer)
    else:  # one threshold for all layers: they end at different sparsities
        assert max(per_layer) - min(per_layer) > 0.05


def test_unknown_method_and_bad_amounts():
    cfg = _cfg("textcnn")
    with pytest.raises(ValueError, match="unknown method"):
        prune(build_model(cfg, VOCAB, 2), cfg, "magic", 0.5)
    for amount in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"prune.amount must be in \[0, 1\)"):
            prune(build_model(cfg, VOCAB, 2), cfg, "structured", amount)
    with pytest.raises(ValueError):
        PruneConfig(amount=1.0)


def test_round_schedule():
    assert PruneConfig(amount=0.6, rounds=3, schedule="linear").round_amounts() == pytest.approx([0.2, 0.4, 0.6])
    cubic = PruneConfig(amount=0.5, rounds=3).round_amounts()
    assert cubic[-1] == pytest.approx(0.5) and cubic == sorted(cubic) and cubic[0] > 0.5 / 3  # fast first
    assert PruneConfig(amount=0.5).round_amounts() == [0.5]


def test_sparse_checkpoint_is_smaller_and_loads_back_dense(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(embed_dim=64, num_filters=32)
    model = build_model(cfg, {"word": 3000}, 2)
    save_checkpoint(tmp_path / "dense.pt", {"model": model.state_dict()})
    prune(model, cfg, "global_unstructured", 0.8)
    save_checkpoint(tmp_path / "sparse.pt", {"model": model.state_dict(), "epoch": 1})
    ratio = os.path.getsize(tmp_path / "dense.pt") / os.path.getsize(tmp_path / "sparse.pt")
    assert ratio > 3.5  # 20% of the values + a 1-bit map: about 4.3x
    state = load_checkpoint(tmp_path / "sparse.pt")
    assert state["epoch"] == 1
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value)


def test_measurements_and_tradeoff_plot(tmp_path, small_csv):
    from training.overrides import apply_overrides
    from training.presets import tiny
    from training.data.prepare import load_manifest, prepare_dataset
    from training.measure import measure_checkpoint, plot_pruning_tradeoff

    cfg = apply_overrides(tiny(), [f"data.dataset={small_csv}", "data.max_samples=null"])
    prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "prepared")
    manifest = load_manifest(tmp_path / "prepared")
    model = build_model(cfg.model, {"word": manifest["vocab_size"], "char": manifest["char_vocab_size"]}, 2)
    state = {"model_config": cfg.model.model_dump(), "vocab_sizes": {"word": manifest["vocab_size"], "char": manifest["char_vocab_size"]},
             "num_classes": 2}
    save_checkpoint(tmp_path / "dense.pt", {**state, "model": model.state_dict()})
    small, small_cfg = prune(model, cfg.model, "structured", 0.5)
    save_checkpoint(tmp_path / "small.pt", {**state, "model": small.state_dict(), "model_config": small_cfg.model_dump()})
    dense, pruned = (measure_checkpoint(str(tmp_path / f"{n}.pt"), str(tmp_path / "prepared"), cfg.preprocess.max_len)
                     for n in ("dense", "small"))
    for m in (dense, pruned):
        assert 0 < m["latency_b1_p50_ms"] <= m["latency_b1_p95_ms"] and 0 < m["latency_b64_p50_ms"] <= m["latency_b64_p95_ms"]
    assert dense["file_bytes"] == os.path.getsize(tmp_path / "dense.pt") > pruned["file_bytes"]
    assert pruned["params"] < 0.6 * dense["params"]
    png = plot_pruning_tradeoff([(0.0, 0.8, 5.0, 9e5), (0.5, 0.79, 2.0, 4e5)], tmp_path / "t.png", "structured")
    assert png.read_bytes()[:4] == b"\x89PNG"


def _fasttext_round(tmp_path, small_csv, experiment, settings, init=None):
    """One real prune round (and the report) in a Prefect flow, on an untrained fastText model of the small corpus
    (``init``: a function that sets its weights), as the pipeline runs them: (the round, the report)."""
    import mlflow
    from prefect import flow
    from torch.utils.data import DataLoader

    from tasks.prune import prune_report, prune_round
    from tasks.tracking import open_stage_run
    from training.data.prepare import load_manifest, prepare_dataset
    from training.evaluate import open_split
    from training.overrides import apply_overrides
    from training.presets import tiny

    cfg = apply_overrides(tiny(), [f"data.dataset={small_csv}", "data.max_samples=null", "model.name=fasttext",
                                   "model.buckets=4096", *settings])
    prepare_dataset(cfg.data, cfg.preprocess, tmp_path / "prepared")
    manifest = load_manifest(tmp_path / "prepared")
    vocab = {"word": manifest["vocab_size"], "char": manifest["char_vocab_size"]}
    model = build_model(cfg.model, vocab, 2)
    if init:
        train = open_split(tmp_path / "prepared", "train", cfg.model, cfg.preprocess.max_len)
        init(model, DataLoader(train, batch_size=64, collate_fn=train.collate))
    checkpoint = str(tmp_path / "trained.pt")
    save_checkpoint(checkpoint, {"model_config": cfg.model.model_dump(), "vocab_sizes": vocab, "num_classes": 2,
                                 "model": model.state_dict()})
    prepared = {"path": str(tmp_path / "prepared")}

    @flow
    def pruning():
        client = mlflow.MlflowClient()
        run = client.create_run(client.create_experiment(experiment))  # the pipeline's parent
        parent = {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "experiment": experiment,
                  "work_dir": str(tmp_path / "work")}
        prune_parent = open_stage_run(parent, "prune")
        done = prune_round(cfg, checkpoint, prepared, prune_parent, 1, cfg.prune.amount)
        evaluated = {"checkpoint": done["checkpoint"], "metrics": {"test_macro_f1": 0.5}}
        trained = {"best_checkpoint": checkpoint, "best_val_macro_f1": 0.5}
        return done, prune_report(cfg, trained, evaluated, [done], evaluated, prepared, prune_parent)

    return model, checkpoint, pruning()


def test_a_round_that_removes_no_weight_is_not_fine_tuned_and_the_report_says_nothing_changed(tmp_path, small_csv, mlflow_store, prefect_server):
    """fastText's tables start at zero and keep zeros in every row no text touched: a model already sparser than the
    round asks loses nothing to it; no fine-tuning epoch, the same checkpoint, ratios of exactly 1."""
    import mlflow

    model, checkpoint, (done, report) = _fasttext_round(tmp_path, small_csv, "prune-noop", ["prune.amount=0.3"])
    assert sparsity(model)["sparsity_prunable"] > 0.3  # the zero tables
    assert done["removed"] == 0 and not done["finetuned"] and done["checkpoint"] == checkpoint
    assert not (tmp_path / "work" / "prune" / "prune_round_1" / "finetune").exists()
    m = report["metrics"]
    assert m["removed_params"] == 0 and m["speedup_b64"] == m["file_size_ratio"] == 1.0  # measured once: no noise
    assert mlflow.MlflowClient().get_run(report["rounds"][0]).data.metrics["removed_params"] == 0


def test_a_fine_tune_that_lowers_validation_is_discarded_and_the_round_keeps_the_pruned_model(tmp_path, small_csv, mlflow_store, prefect_server):
    """A model that scores well before any step (the nearest-centroid start), pruned, then fine-tuned at a learning
    rate that wrecks it: the round keeps the pruned model, says so, and the report measures that one."""
    import mlflow

    from training.models.fasttext import centroid_init

    _, _, (done, report) = _fasttext_round(
        tmp_path, small_csv, "prune-discard", ["model.buckets=64", "model.embed_dim=2", "prune.amount=0.5", "prune.finetune_lr=10", "prune.finetune_epochs=1",
                                               "model.dropout=0", "model.init=centroids"], init=centroid_init)
    assert done["val_macro_f1_after_prune"] > 0.8  # the pruned model still tells the classes apart
    assert done["finetune_discarded"] and not done["finetuned"]
    assert done["checkpoint"].endswith("pruned.pt") and done["best_val_macro_f1"] == done["val_macro_f1_after_prune"]
    tuned = mlflow.MlflowClient().get_run(report["rounds"][0])
    assert tuned.data.metrics["finetune_kept"] == 0 and "finetune_discarded" in tuned.data.tags
    assert report["metrics"]["removed_params"] > 0
