import pytest
import torch

from training.config import ModelConfig
from training.data.dataset import pad_batch
from training.models import build_model, min_input_len
from training.prune import global_l1_prune, prunable_weights, sparsity

FAMILIES = ["textcnn", "bilstm", "transformer"]
VOCAB = {"word": 50, "char": 30}


def _cfg(name, **kw):
    return ModelConfig(name=name, embed_dim=16, num_filters=8, kernel_sizes=[2, 3, 5], hidden_size=8, num_heads=2,
                       dropout=0.1, **kw)


def _batch(cfg):
    items = [({"word": torch.tensor([4, 5]), "char": torch.tensor([3, 4, 5])}, 0),
             ({"word": torch.tensor([6, 7, 8, 9]), "char": torch.tensor([6, 7])}, 1),
             ({"word": torch.tensor([], dtype=torch.long), "char": torch.tensor([], dtype=torch.long)}, 1)]  # empty text
    return pad_batch(items, min_len=min_input_len(cfg))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("inputs", ["word", "char", "both"])
def test_shapes_gradients_and_padding(name, inputs):
    torch.manual_seed(0)
    cfg = _cfg(name, input=inputs)
    model = build_model(cfg, VOCAB, num_classes=3)
    batch, labels = _batch(cfg)
    logits = model(batch)
    assert logits.shape == (3, 3) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits, labels).backward()
    for name_, encoder in model.encoders.items():
        assert encoder.embedding.weight.grad[0].abs().sum() == 0  # padding row never learns
    assert set(model.encoders) == ({"word", "char"} if inputs == "both" else {inputs})


@pytest.mark.parametrize("name", FAMILIES)
def test_padding_does_not_change_the_prediction(name):
    """The same text padded to different widths gives the same logits (masks work)."""
    torch.manual_seed(0)
    cfg = _cfg(name)
    model = build_model(cfg, VOCAB, num_classes=2).eval()
    short = torch.tensor([[4, 5, 6, 7, 8]])
    long = torch.cat([short, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    assert torch.allclose(model({"word": short}), model({"word": long}), atol=1e-5)


def test_textcnn_pads_to_the_widest_kernel():
    cfg = _cfg("textcnn")
    batch, _ = pad_batch([(torch.tensor([4, 5]), 0)], min_len=min_input_len(cfg))
    assert batch["word"].shape == (1, 5)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_transformer_positions(positions):
    model = build_model(_cfg("transformer", positions=positions), VOCAB, 2).eval()
    x = torch.tensor([[4, 5, 6]])
    assert not torch.allclose(model({"word": x}), model({"word": x.flip(1)}))  # order matters


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_prunes_globally(name):
    model = build_model(_cfg(name), VOCAB, 2)
    assert prunable_weights(model)
    global_l1_prune(model, 0.5)
    assert sparsity(model)["sparsity_prunable"] == pytest.approx(0.5, abs=0.01)
    batch, _ = _batch(_cfg(name))
    assert torch.isfinite(model(batch)).all()  # still runs, no masks left
    assert not any("_orig" in n for n, _ in model.named_parameters())


def test_transformer_heads_must_divide_embedding():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ModelConfig(name="transformer", embed_dim=30, num_heads=4)
