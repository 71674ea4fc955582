"""Where a training step's time goes, in the worker's pieces: loading the batch, forward and backward (DDP's
all-reduce of its buckets inside), the worker's exchange of embedding-table rows, gradient clipping, the optimiser
step. One epoch, 1 thread a process; run alone or under torchrun (gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.step_profile PREPARED FAMILY OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from training import distributed
from training.data.dataset import train_sampler
from training.data.prepare import load_manifest
from training.evaluate import open_split
from training.models import family_of
from training.presets import preset
from training.worker import clip_gradients, make_optimizer, row_exchange_tables

PARTS = ("load", "forward and backward", "table exchange", "clipping", "optimiser")


def main(prepared: str, name: str, out: str) -> None:
    torch.set_num_threads(1)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    cfg = preset("default", name)
    family, manifest = family_of(cfg.model), load_manifest(prepared)
    sizes = family.sizes(manifest, cfg.model, cfg.preprocess.max_len)
    torch.manual_seed(0)
    model = family.build(cfg.model, sizes, len(manifest["labels"]))
    tables = row_exchange_tables(model) if world > 1 else []  # as the worker does on gloo
    if tables:
        ignore = {id(m.weight) for m in tables}
        DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, p in model.named_parameters() if id(p) in ignore])
    trained = DDP(model) if world > 1 else model
    data = open_split(prepared, "train", cfg.model, cfg.preprocess.max_len, sizes)
    batch = cfg.train.batch_size
    loader = DataLoader(data, batch_size=batch, sampler=train_sampler(data, cfg.train, world, rank), collate_fn=data.collate)
    optimizer = make_optimizer(model, cfg.train.lr, cfg.train.weight_decay, cfg.train.l2 / len(data))
    spent, steps = dict.fromkeys(PARTS, 0.0), 0
    mark = time.perf_counter()
    for inputs, labels in loader:
        times = [time.perf_counter()]
        F.cross_entropy(trained(inputs).float(), labels).backward()
        times.append(time.perf_counter())
        if tables:
            distributed.average_table_gradients(tables, world)
        times.append(time.perf_counter())
        clip_gradients(model.parameters(), cfg.train.grad_clip)
        times.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
        for part, start, end in zip(PARTS, [mark] + times, times):
            spent[part] += end - start
        mark, steps = times[-1], steps + 1
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"steps": steps, "ms": {part: 1000 * s / steps for part, s in spent.items()}}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
