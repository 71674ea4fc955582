import json

import pytest
import torch

from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.config import ModelConfig
from training.models import build_model
from training.prune import global_l1_prune, sparsity


def _model():
    torch.manual_seed(0)
    return build_model(ModelConfig(embed_dim=16, num_filters=8, kernel_sizes=[2, 3]), {"word": 100}, num_classes=2)


def test_global_l1_reaches_the_amount_and_is_permanent():
    model = _model()
    assert sparsity(model, include_embedding=False)["sparsity_prunable"] == 0
    global_l1_prune(model, 0.6)
    stats = sparsity(model)
    assert stats["sparsity_prunable"] == pytest.approx(0.6, abs=0.01)
    assert not any(name.endswith("_mask") or name.endswith("_orig") for name, _ in model.named_parameters())
    assert not list(model.named_buffers())
    assert any("embedding" in k for k in stats)  # embeddings pruned too (they hold most of the weights)
    model = _model()
    global_l1_prune(model, 0.6, include_embedding=False)
    assert model.encoders["word"].embedding.weight.ne(0).float().mean() > 0.9
    # global, not per layer: layers end at different sparsities
    per_layer = [v for k, v in stats.items() if k.startswith("sparsity.")]
    assert max(per_layer) - min(per_layer) > 0.01


def test_prune_amount_bounds():
    with pytest.raises(ValueError, match=r"prune.amount must be in \[0, 1\)"):
        global_l1_prune(_model(), 1.0)
    model = _model()
    global_l1_prune(model, 0.0)
    assert sparsity(model, include_embedding=False)["sparsity_prunable"] == 0


def test_checkpoint_round_trip_and_digest(tmp_path):
    model = _model()
    path = tmp_path / "best.pt"
    digest = save_checkpoint(path, {"model": model.state_dict(), "epoch": 3}, epoch=3)
    assert json.loads((tmp_path / "best.pt.json").read_text())["sha256"] == digest
    state = load_checkpoint(path)
    assert state["epoch"] == 3
    assert torch.equal(state["model"]["classifier.weight"], model.classifier.weight)
    assert not list(tmp_path.glob(".*.tmp"))

    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(path)


def test_checkpoint_refuses_pickled_code(tmp_path):
    """weights_only=True: a checkpoint that would run code on load is rejected even with a matching digest."""
    import hashlib
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, path)
    (tmp_path / "evil.pt.json").write_text(json.dumps({"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path)
