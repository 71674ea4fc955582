import torch

from training.config import ModelConfig
from training.data.dataset import pad_batch
from training.models import build_model, min_input_len


def test_textcnn_shapes_and_padding():
    cfg = ModelConfig(embed_dim=16, num_filters=8, kernel_sizes=[2, 3, 5], dropout=0.1)
    model = build_model(cfg, vocab_size=50, num_classes=3)
    tokens, labels = pad_batch([(torch.tensor([4, 5]), 0), (torch.tensor([6, 7, 8, 9]), 2)], min_len=min_input_len(cfg))
    assert tokens.shape == (2, 5)  # padded up to the widest kernel
    assert tokens[0, 2:].eq(0).all()
    logits = model(tokens)
    assert logits.shape == (2, 3)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    assert model.embedding.weight.grad[0].abs().sum() == 0  # padding row never learns


def test_textcnn_handles_an_empty_text():
    cfg = ModelConfig(embed_dim=8, num_filters=4, kernel_sizes=[3])
    model = build_model(cfg, vocab_size=10, num_classes=2).eval()
    tokens, _ = pad_batch([(torch.tensor([], dtype=torch.long), 1)], min_len=min_input_len(cfg))
    assert torch.isfinite(model(tokens)).all()
