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

import torch
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

def _keep(n_original: int, amount: float) -> int:
    return max(1, round(n_original * (1 - amount)))


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores (all of them if fewer), in their original order."""
    return torch.topk(scores, min(k, len(scores))).indices.sort().values


def _rows(idx: torch.Tensor, block: int, blocks: int) -> torch.Tensor:
    """Row indices of units ``idx`` in a matrix of ``blocks`` stacked blocks of ``block`` rows (LSTM gates, q/k/v)."""
    return torch.cat([idx + b * block for b in range(blocks)])


def structured_prune(
    model: nn.Module, cfg: ModelConfig, amount: float, include_embedding: bool = True, reference: ModelConfig | None = None
) -> tuple[nn.Module, ModelConfig]:
    """A smaller model of the same family: the ``amount`` share of units (of ``reference``'s sizes) removed."""
    from training.models import build_model

    _check_amount(amount)
    ref = reference or cfg
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new: dict[str, torch.Tensor] = {}
    update: dict = {}
    classifier_cols, offset = [], 0
    for name, encoder in model.encoders.items():
        p = f"encoders.{name}."
        emb = sd[p + "embedding.weight"]
        dims = torch.arange(emb.size(1))
        if include_embedding and cfg.name in ("textcnn", "bilstm"):
            dims = _top(emb.norm(dim=0), _keep(ref.embed_dim, amount))
            update["embed_dim"] = len(dims)
        new[p + "embedding.weight"] = emb[:, dims]
        if cfg.name == "textcnn":
            n_keep = _keep(ref.num_filters, amount)
            for i in range(len(cfg.kernel_sizes)):
                w, b = sd[f"{p}convs.{i}.weight"][:, dims], sd[f"{p}convs.{i}.bias"]
                keep = _top(w.flatten(1).norm(dim=1), n_keep)
                new[f"{p}convs.{i}.weight"], new[f"{p}convs.{i}.bias"] = w[keep], b[keep]
                classifier_cols.append(keep + offset)
                offset += w.size(0)
            update["num_filters"] = n_keep
        elif cfg.name == "bilstm":
            h, n_keep = cfg.hidden_size, _keep(ref.hidden_size, amount)
            inputs = dims  # input columns of layer 0: the kept embedding dimensions
            for layer in range(cfg.num_layers):
                kept = []
                for suffix, shift in (("", 0), ("_reverse", h)):
                    k = f"{p}lstm.weight_ih_l{layer}{suffix}", f"{p}lstm.weight_hh_l{layer}{suffix}"
                    kb = f"{p}lstm.bias_ih_l{layer}{suffix}", f"{p}lstm.bias_hh_l{layer}{suffix}"
                    w_ih, w_hh = sd[k[0]], sd[k[1]]
                    score = (w_ih.view(4, h, -1).pow(2).sum((0, 2)) + w_hh.view(4, h, -1).pow(2).sum((0, 2))).sqrt()
                    units = _top(score, n_keep)
                    rows = _rows(units, h, 4)
                    new[k[0]], new[k[1]] = w_ih[rows][:, inputs], w_hh[rows][:, units]
                    new[kb[0]], new[kb[1]] = sd[kb[0]][rows], sd[kb[1]][rows]
                    kept.append(units + shift)
                inputs = torch.cat(kept)  # the next layer (and the attention) read both directions' outputs
            new[p + "attention.weight"], new[p + "attention.bias"] = sd[p + "attention.weight"][:, inputs], sd[p + "attention.bias"]
            classifier_cols.append(inputs + offset)
            offset += 2 * h
            update["hidden_size"] = n_keep
        else:  # transformer: heads and feed-forward units; the residual width stays
            hd = cfg.head_dim or cfg.embed_dim // cfg.num_heads
            ref_ffn = ref.ffn_dim or 4 * ref.embed_dim
            n_heads, n_ffn = _keep(ref.num_heads, amount), _keep(ref_ffn, amount)
            for layer in range(cfg.num_layers):
                q = f"{p}layers.{layer}."
                qkv, qkv_b, out = sd[q + "qkv.weight"], sd[q + "qkv.bias"], sd[q + "out.weight"]
                a = cfg.num_heads * hd
                head_score = (qkv.view(3, cfg.num_heads, hd, -1).pow(2).sum((0, 2, 3))
                              + out.view(-1, cfg.num_heads, hd).pow(2).sum((0, 2))).sqrt()
                heads = _top(head_score, n_heads)
                cols = (heads[:, None] * hd + torch.arange(hd)[None, :]).flatten()  # the kept heads' columns
                rows = _rows(cols, a, 3)
                new[q + "qkv.weight"], new[q + "qkv.bias"], new[q + "out.weight"] = qkv[rows], qkv_b[rows], out[:, cols]
                ff1, ff1_b, ff2 = sd[q + "ff1.weight"], sd[q + "ff1.bias"], sd[q + "ff2.weight"]
                units = _top(ff1.norm(dim=1) * ff2.norm(dim=0), n_ffn)
                new[q + "ff1.weight"], new[q + "ff1.bias"], new[q + "ff2.weight"] = ff1[units], ff1_b[units], ff2[:, units]
            update.update(num_heads=n_heads, head_dim=hd, ffn_dim=n_ffn)
            classifier_cols.append(torch.arange(encoder.out_dim) + offset)
            offset += encoder.out_dim
    new["classifier.weight"] = sd["classifier.weight"][:, torch.cat(classifier_cols)]
    new_cfg = cfg.model_copy(update=update)
    vocab_sizes = {name: enc.embedding.num_embeddings for name, enc in model.encoders.items()}
    pruned = build_model(new_cfg, vocab_sizes, model.classifier.out_features)
    pruned.load_state_dict({k: new.get(k, v) for k, v in sd.items()})
    pruned.train(model.training)
    return pruned, new_cfg


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
