"""Pruning: global L1 unstructured, made permanent, and sparsity measurements.

    from training.prune import global_l1_prune, sparsity
    global_l1_prune(model, amount=0.5)   # half of the conv/linear weights set to zero, masks removed
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

def prunable_weights(model: nn.Module, include_embedding: bool = False) -> list[tuple[nn.Module, str]]:
    """The weight matrices of convolutions, linear layers, LSTMs and attention (and embeddings if asked)."""
    out: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        if isinstance(module, (nn.Conv1d, nn.Linear)) or (include_embedding and isinstance(module, nn.Embedding)):
            out.append((module, "weight"))
        elif isinstance(module, nn.LSTM):
            names = [n for n in module._flat_weights_names if n.startswith("weight")]
            out.extend((module, n) for n in names)
        elif isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
            out.append((module, "in_proj_weight"))
    return out


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    return getattr(module, name)


def sparsity(model: nn.Module, include_embedding: bool = False) -> dict[str, float]:
    """Share of exact zeros: over the prunable weights, per layer, and over all parameters."""
    names = {m: n for n, m in model.named_modules()}
    per_layer, zeros, total = {}, 0, 0
    for module, name in prunable_weights(model, include_embedding):
        w = _weight(module, name)
        z = int((w == 0).sum())
        per_layer[f"sparsity.{names[module]}.{name}"] = z / w.numel()
        zeros, total = zeros + z, total + w.numel()
    all_zeros = sum(int((p == 0).sum()) for p in model.parameters())
    all_total = sum(p.numel() for p in model.parameters())
    return {
        "sparsity_prunable": zeros / max(1, total),
        "sparsity_all_params": all_zeros / max(1, all_total),
        "prunable_params": float(total),
        "nonzero_params": float(all_total - all_zeros),
        **per_layer,
    }


def global_l1_prune(model: nn.Module, amount: float, include_embedding: bool = False) -> nn.Module:
    """Zero the ``amount`` share of smallest-magnitude weights across all prunable layers, permanently."""
    if not 0 <= amount < 1:
        raise ValueError(f"prune.amount must be in [0, 1), got {amount}")
    targets = prunable_weights(model, include_embedding)
    if amount == 0 or not targets:
        return model
    torch_prune.global_unstructured(targets, pruning_method=torch_prune.L1Unstructured, amount=amount)
    for module, name in targets:
        torch_prune.remove(module, name)  # fold the mask in: plain tensors, no hooks left
    return model
