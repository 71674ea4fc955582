"""Pruning that makes the model smaller (and, structured, faster), made permanent.

    from training.prune import prune, sparsity
    model, cfg = prune(model, cfg, "global_unstructured", 0.8)  # 80% of the weights zero; stored compressed
    model, cfg = prune(model, cfg, "structured", 0.5)           # half the filters / units / heads removed

- ``global_unstructured``: the smallest weights across all prunable layers set to zero
  (``torch.nn.utils.prune.global_unstructured``; magnitudes relative to each layer's RMS, so that one layer's
  scale does not decide), masks folded in; layers end at different sparsities. The checkpoint stores the zeros as a
  bitmap (training.checkpoint), so the file shrinks with sparsity; the model in memory stays dense.
- ``l1_unstructured``: the same share in every layer (``torch.nn.utils.prune.l1_unstructured``).
- ``structured``: whole units ranked by L2 norm and physically removed, giving a model of the same family
  with smaller layers (its ModelConfig says how small): TextCNN filters, BiLSTM hidden units, Transformer
  attention heads and feed-forward units, and embedding dimensions (TextCNN, BiLSTM) when
  ``include_embedding``. The same share is removed in every layer, at least one unit is kept.

Amounts are cumulative and relative to the original model (``reference``): pruning a model that already
lost 35% to 50% removes the next 15%, which is how the iterative schedule works.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import prune as torch_prune

from training.config import ModelConfig

METHODS = ("global_unstructured", "l1_unstructured", "structured")


def prunable_weights(model: nn.Module, include_embedding: bool = False) -> list[tuple[nn.Module, str]]:
    """The weight matrices of convolutions, linear layers and LSTMs (and embeddings if asked)."""
    out: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        if isinstance(module, (nn.Conv1d, nn.Linear)) or (include_embedding and isinstance(module, nn.Embedding)):
            out.append((module, "weight"))
        elif isinstance(module, nn.LSTM):
            out.extend((module, n) for n in module._flat_weights_names if n.startswith("weight"))
    return [(m, n) for m, n in out if getattr(m, n).numel()]


def sparsity(model: nn.Module, include_embedding: bool = True) -> dict[str, float]:
    """Share of exact zeros: over the prunable weights, per layer, and over all parameters."""
    names = {m: n for n, m in model.named_modules()}
    per_layer, zeros, total = {}, 0, 0
    for module, name in prunable_weights(model, include_embedding):
        w = getattr(module, name)
        z = int((w == 0).sum())
        per_layer[f"sparsity.{names[module]}.{name}"] = z / w.numel()
        zeros, total = zeros + z, total + w.numel()
    all_zeros = sum(int((p == 0).sum()) for p in model.parameters())
    all_total = sum(p.numel() for p in model.parameters())
    return {
        "sparsity_prunable": zeros / max(1, total),
        "sparsity_all_params": all_zeros / max(1, all_total),
        "params": float(all_total),
        "nonzero_params": float(all_total - all_zeros),
        **per_layer,
    }


def _check_amount(amount: float) -> None:
    if not 0 <= amount < 1:
        raise ValueError(f"prune.amount must be in [0, 1), got {amount}")


def unstructured_prune(model: nn.Module, amount: float, include_embedding: bool = True, per_layer: bool = False) -> nn.Module:
    """Zero the ``amount`` share of smallest-magnitude weights (globally, or in each layer), permanently."""
    _check_amount(amount)
    targets = prunable_weights(model, include_embedding)
    if amount == 0 or not targets:
        return model
    if per_layer:
        for module, name in targets:
            torch_prune.l1_unstructured(module, name, amount=amount)
    else:
        # one threshold over all layers, on magnitudes relative to each layer's RMS: raw magnitudes would let the layer
        # on the largest scale (the embeddings) keep everything and zero whole convolutions and the classifier
        scores = {(m, n): getattr(m, n).detach().abs() / getattr(m, n).detach().pow(2).mean().sqrt().clamp(min=1e-12)
                  for m, n in targets}
        torch_prune.global_unstructured(targets, pruning_method=torch_prune.L1Unstructured, amount=amount,
                                        importance_scores=scores)
    for module, name in targets:
        torch_prune.remove(module, name)  # fold the mask in: plain tensors, no hooks left
    return model


def global_l1_prune(model: nn.Module, amount: float, include_embedding: bool = True) -> nn.Module:
    return unstructured_prune(model, amount, include_embedding)


# ---- structured ------------------------------------------------------------------

def structured_prune(
    model: nn.Module, cfg: ModelConfig, amount: float, include_embedding: bool = True, reference: ModelConfig | None = None
) -> tuple[nn.Module, ModelConfig]:
    """A smaller model of the same family: the ``amount`` share of units (of ``reference``'s sizes) removed; how the
    units are ranked and cut is the family's (``Family.structured_prune``)."""
    from training.models import family_of

    _check_amount(amount)
    return family_of(cfg).structured_prune(model, cfg, amount, include_embedding, reference or cfg)


def prune(
    model: nn.Module, cfg: ModelConfig, method: str, amount: float, include_embedding: bool = True,
    reference: ModelConfig | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Apply one method; returns the (possibly new, smaller) model and its ModelConfig."""
    if method == "structured":
        return structured_prune(model, cfg, amount, include_embedding, reference)
    if method not in METHODS:
        raise ValueError(f"prune.method: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return unstructured_prune(model, amount, include_embedding, per_layer=method == "l1_unstructured"), cfg
