"""What a model costs to ship and run: parameters, file size, sparsity and CPU inference latency.

    from training.measure import measure_checkpoint
    measure_checkpoint("best.pt", prepared_dir, max_len=128, threads=1)
    # {"params": 1.4e6, "nonzero_params": ..., "file_bytes": ..., "latency_b64_p50_ms": 6.1, ...}

Latency is the forward pass on already encoded test texts (segmentation is the same for every model and
is measured in bench/), after warm-up, on a fixed number of CPU threads, one timing per batch.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

from training.data.dataset import EncodedSplit
from training.evaluate import load_model, open_split
from training.prune import sparsity

BATCH_SIZES = (1, 64)
_THREADS = threading.Lock()  # torch's thread count is per process: parallel sweep trials measure one at a time


@torch.inference_mode()
def latency(model: torch.nn.Module, split: EncodedSplit, threads: int = 1,
            batch_sizes: tuple[int, ...] = BATCH_SIZES, timings: int = 60, warmup: int = 10) -> dict[str, float]:
    """p50 and p95 milliseconds per batch for each batch size, over ``timings`` batches of real texts."""
    model.eval()
    out = {}
    with _THREADS:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for size in batch_sizes:
                times = _timings(model, split, size, timings, warmup)
                out[f"latency_b{size}_p50_ms"] = float(np.percentile(times, 50))
                out[f"latency_b{size}_p95_ms"] = float(np.percentile(times, 95))
        finally:
            torch.set_num_threads(previous)
    return out


def _timings(model, split: EncodedSplit, size: int, timings: int, warmup: int) -> list[float]:
    n_batches = max(1, min(timings, len(split) // size))
    batches = [split.collate([split[(i * size + j) % len(split)] for j in range(size)])[0] for i in range(n_batches)]
    for i in range(warmup):
        model(batches[i % len(batches)])
    times = []
    for i in range(max(timings, len(batches))):
        start = time.perf_counter()
        model(batches[i % len(batches)])
        times.append(1000 * (time.perf_counter() - start))
    return times


def measure_checkpoint(checkpoint: str, prepared_dir: str, max_len: int, threads: int = 1, split: str = "test") -> dict[str, float]:
    """Sparsity (global and per layer), parameters, file size and latency of a saved model."""
    model, cfg, state = load_model(checkpoint)
    data = open_split(prepared_dir, split, cfg, max_len, state["sizes"])
    return {
        **sparsity(model),
        "file_bytes": float(os.path.getsize(checkpoint)),
        **latency(model, data, threads),
    }


def plot_pruning_tradeoff(points: list[tuple[float, float, float, float]], path, title: str):
    """Amount against validation macro-F1 and batch-64 latency (and file size), one point per pruned model.

    ``points``: (amount, val macro-F1, latency b64 p50 ms, file bytes), the unpruned model at amount 0.
    """
    from training.metrics import _pyplot, save_figure

    plt, _ = _pyplot([])
    points = sorted(points)
    amounts = [100 * a for a, *_ in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(amounts, [f for _, f, _, _ in points], "o-", color="tab:blue", label="val macro-F1")
    ax.set_xlabel("pruned (%)")
    ax.set_ylabel("validation macro-F1", color="tab:blue")
    right = ax.twinx()
    right.plot(amounts, [lat for _, _, lat, _ in points], "s--", color="tab:red", label="latency b64 p50")
    right.set_ylabel("batch-64 latency p50 (ms)", color="tab:red")
    for amount, f1, _, size in points:
        ax.annotate(f"{size / 1e3:.0f} kB", (100 * amount, f1), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_title(title)
    return save_figure(fig, path)
