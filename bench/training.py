"""Training throughput: the worker against a bare PyTorch loop, and 1 against 2 DDP processes, per family."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from bench.common import Timing, quick_size, verdict
from training.job import WorkerJob
from training.worker import clip_gradients, make_optimizer
from training.presets import preset
from training.data.dataset import LengthGroupedSampler, train_sampler
from training.data.prepare import load_manifest, prepare_dataset
from training.evaluate import autocast, open_split
from training.models import family_of
from training.events import read_result

FAMILIES = ("fasttext", "textcnn", "bilstm", "transformer")
# texts prepared per family: fastText's epoch on 1,500 training texts lasted well under a second, and its figures
# spread by 20-29% between runs; on the whole corpus an epoch lasts several seconds
SAMPLES = {"fasttext": None}
EPOCHS = 2  # the rate of the last epoch is used: the first pays for warm-up


def _worker_rate(prepared: Path, family: str, nproc: int, tmp: Path, threads: int | None = None, copies: int = 1) -> float:
    """The worker's training samples/s (the last epoch's); with ``copies``, that many independent runs at once (no
    DDP between them), their rates summed: what the machine gives several processes that exchange nothing."""
    cfg = preset("default", family)
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("MLFLOW_RUN_ID", None)
    outs, running = [], []
    for _ in range(copies):
        out = tmp / f"{family}-{nproc}-{time.monotonic_ns()}"
        job = WorkerJob(stage="train", prepared_dir=str(prepared), out_dir=str(out), model=cfg.model,
                        train=cfg.train.model_copy(update={"epochs": EPOCHS, "patience": EPOCHS}), max_len=cfg.preprocess.max_len)
        out.mkdir(parents=True)
        (out / "job.json").write_text(job.model_dump_json())
        outs.append(out)
        running.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                         str(nproc), "-m", "training.worker", "--config", str(out / "job.json")],
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for process in running:
        if process.wait():
            raise subprocess.CalledProcessError(process.returncode, process.args)
    return sum(read_result(out)["epoch_samples_per_second"][-1] for out in outs)


def model_and_train_split(prepared: Path, cfg):
    """The family, a fresh model of ``cfg.model`` for the prepared data, and its train split."""
    manifest = load_manifest(prepared)
    family = family_of(cfg.model)
    sizes = family.sizes(manifest, cfg.model, cfg.preprocess.max_len)
    model = family.build(cfg.model, sizes, len(manifest["labels"]))
    return family, model, open_split(prepared, "train", cfg.model, cfg.preprocess.max_len, sizes)


def bare_rate(prepared: Path, cfg, threads: int | None = None, precision: str = "fp32") -> float:
    """The same model, batches, precision, clipping and threads in the plainest loop: no DDP, no logging, no
    validation (the last epoch's training samples/s)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    _, model, data = model_and_train_split(prepared, cfg)
    # the worker's batches (texts grouped by length unless train.group_by_length is off): the same padding
    sampler = train_sampler(data, cfg.train)
    loader = DataLoader(data, batch_size=cfg.train.batch_size, sampler=sampler, collate_fn=data.collate)
    optimizer = make_optimizer(model, cfg.train.lr, cfg.train.weight_decay, cfg.train.l2 / len(data))  # AdamW (and SparseAdam for sparse tables)
    model.train()
    rate = 0.0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        started, seen = time.perf_counter(), 0
        for inputs, labels in loader:
            with autocast(precision, torch.device("cpu")):
                logits = model(inputs).float()
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            if cfg.train.grad_clip > 0:  # the same training: the worker clips (and so does the Trainer)
                clip_gradients(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            seen += len(labels)
        rate = seen / (time.perf_counter() - started)
    return rate


def step_padding(prepared: Path, cfg, world: int = 2, epochs: int = 3) -> dict[str, float]:
    """The padded tokens of a training step on this split, as the worker's samplers draw its batches: texts are padded
    to their batch's longest, and a step of ``world`` processes waits for the rank with the widest batch. ``ddp``: a
    step of ``world`` processes against one process's step, batches grouped by length (``train.group_by_length``, the
    default); ``ddp_random``: the same with batches drawn at random; ``grouped``: one process's step with grouped
    batches against random ones. Means over ``epochs`` epochs' steps (the family's inputs, cut at their limits)."""
    data = open_split(prepared, "train", cfg.model, cfg.preprocess.max_len)
    widths = [np.minimum(np.diff(offsets), data.limits[name]) for name, (_, offsets) in data.arrays.items()]
    batch = cfg.train.batch_size

    def step_tokens(ranks: int, grouped: bool) -> float:
        tokens = []
        for epoch in range(epochs):
            if grouped:
                samplers = [LengthGroupedSampler(data.lengths(), batch, ranks, rank, seed=epoch) for rank in range(ranks)]
            else:
                samplers = [DistributedSampler(range(len(data)), ranks, rank, seed=epoch) for rank in range(ranks)]
            shares = [np.fromiter(s, dtype=np.int64) for s in samplers]
            for at in range(0, len(shares[0]), batch):
                tokens.append(max(len(share[at:at + batch]) * sum(int(w[share[at:at + batch]].max()) for w in widths)
                                  for share in shares))
        return float(np.mean(tokens))

    return {"ddp": step_tokens(world, True) / step_tokens(1, True),
            "ddp_random": step_tokens(world, False) / step_tokens(1, False),
            "grouped": step_tokens(1, True) / step_tokens(1, False)}


def step_profile(prepared: Path, family: str, nproc: int, tmp: Path) -> dict[str, float]:
    """Milliseconds a step spends in each part (``bench.step_profile``), 1 thread a process, on rank 0."""
    out = tmp / f"profile-{family}-{nproc}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    "-m", "bench.step_profile", str(prepared), family, str(out)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=Path(__file__).parent.parent)
    return json.loads(out.read_text())["ms"]


def _profile_text(one: dict[str, float], two: dict[str, float]) -> str:
    return ", ".join(f"{part} {one[part]:.1f} and {two[part]:.1f}" for part in one)


def _padding_text(padding: dict[str, dict[str, float]], key: str) -> str:
    values = {f"{v[key]:.2f}x" for v in padding.values()}
    return values.pop() if len(values) == 1 else ", ".join(f"{family} {v[key]:.2f}x" for family, v in padding.items())


def run(quick: bool, repeats: int) -> str:
    families = ("fasttext",) if quick else FAMILIES
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cfg = preset("default")
        rows, findings, sizes, padding, step_ms, profile = [], [], {}, {}, {}, None
        for family in families:
            samples = quick_size(1000, 400) if quick else SAMPLES.get(family, 2000)
            prepared = tmp / f"prepared-{samples}"
            if not prepared.exists():
                prepare_dataset(cfg.data.model_copy(update={"max_samples": samples}), cfg.preprocess, prepared)
            sizes[family] = load_manifest(prepared)["splits"]["train"]["n"]
            padding[family] = step_padding(prepared, preset("default", family))
            rates: dict[str, list[float]] = {"bare loop, 1 process": [], "worker, 1 process": [],
                                             "worker, 2 processes (DDP)": [], "worker, 1 process, 1 thread": [],
                                             "2 independent workers, 1 thread each (no DDP)": []}
            for _ in range(repeats):  # interleaved: A B C D A B C D
                rates["bare loop, 1 process"].append(bare_rate(prepared, preset("default", family)))
                rates["worker, 1 process"].append(_worker_rate(prepared, family, 1, tmp))
                rates["worker, 2 processes (DDP)"].append(_worker_rate(prepared, family, 2, tmp))
                rates["worker, 1 process, 1 thread"].append(_worker_rate(prepared, family, 1, tmp, threads=1))
                rates["2 independent workers, 1 thread each (no DDP)"].append(
                    _worker_rate(prepared, family, 1, tmp, threads=1, copies=2))
            if family == "fasttext":
                profile = [step_profile(prepared, family, nproc, tmp) for nproc in (1, 2)]
            med = {k: Timing(v).median for k, v in rates.items()}
            step_ms[family] = 1000 * cfg.train.batch_size / med["worker, 1 process, 1 thread"]
            for name, values in rates.items():
                t = Timing(values)
                rows.append(f"| {family} | {name} | {t.median:,.0f} (±{100 * t.spread:.0f}%) |")
            overhead = med["worker, 1 process"] / med["bare loop, 1 process"]
            scaling = med["worker, 2 processes (DDP)"] / med["worker, 1 process"]
            per_core = med["worker, 2 processes (DDP)"] / med["worker, 1 process, 1 thread"]
            ceiling = med["2 independent workers, 1 thread each (no DDP)"] / med["worker, 1 process, 1 thread"]
            findings.append(f"- {family}: worker / bare loop = {overhead:.2f} (target at least 0.9: {verdict(overhead >= 0.9)}); "
                            f"2 single-thread processes / 1 single-thread process = {per_core:.2f}x (target at least 1.7: "
                            f"{verdict(per_core >= 1.7)}); 2 independent single-thread workers / 1 = {ceiling:.2f}x, the "
                            f"most 2 processes get from this machine, of which DDP reaches {100 * per_core / ceiling:.0f}%; "
                            f"2 processes / 1 process with both cores' threads = {scaling:.2f}x "
                            "(no target: on 2 cores one process already uses both).")
    per_family = ", ".join(f"{family} {n:,}" for family, n in sizes.items())
    return "\n".join([
        "## Training throughput",
        "",
        f"Training samples/s of the last of {EPOCHS} epochs (training texts: {per_family}), default preset of each family "
        f"(batch {cfg.train.batch_size} per process), {repeats} interleaved runs each, median (± half the range). "
        f"One process uses all {os.cpu_count()} cores' threads; with 2 processes each gets half.",
        "",
        "| family | how | samples/s |",
        "|---|---|---|",
        *rows,
        "",
        *findings,
        "",
        "On 2 cores one process already keeps both busy with intra-op threads, so a second process can only add "
        "the exchange of gradients on top of the same arithmetic: that comparison measures nothing about DDP. The "
        "target is on the single-thread comparison, which shows what DDP itself scales. Two independent workers, each "
        "training its own copy with one thread and exchanging nothing, show what the machine itself gives a second "
        "process (two processes share the memory bandwidth and caches, and on a virtual machine two vCPUs may share a "
        "physical core): DDP cannot do better than that.",
        "",
        "Under DDP on gloo the worker averages every family's embedding tables itself, most of the from-scratch "
        "models' parameters: each rank sends the rows its batches touched, every table's in one all-gather "
        "(`distributed.average_table_gradients`), where DDP would all-reduce every row of a dense table and each "
        "sparse table on its own; the other parameters go through DDP's buckets. Texts are padded to their batch's "
        "longest and a step waits for the rank with the widest batch: with batches drawn at random a step of 2 "
        "processes would pad like the wider of two batches (on these splits " + _padding_text(padding, "ddp_random")
        + " the padded tokens of one process's step). The worker's sampler groups texts of similar length into each "
        "step (`train.group_by_length`, on by default for every family but fastText), so that the ranks of a step "
        "get neighbouring lengths: 2 processes' step then pads " + _padding_text(padding, "ddp") + " one process's, "
        "and any step pads " + _padding_text(padding, "grouped") + " the tokens of a random batch (the rows above "
        "train as each family's default does, the bare loop too: fastText's batches at random, the others' grouped). "
        "What still keeps 2 single-thread processes under 2x: every rank runs the whole "
        "optimiser step, and gloo's collectives between two processes take milliseconds each here, whatever their size.",
        "",
        f"fastText's step of {cfg.train.batch_size} texts lasts about {step_ms['fasttext']:.0f} ms on one thread. "
        + (f"Where its time goes (`bench.step_profile`, ms a step on 1 thread, 1 process and 2 processes' rank 0): "
           f"{_profile_text(*profile)}. The optimiser's update of the rows a batch touched is the largest part of "
           "one process's step; under DDP every rank updates the rows that both ranks' batches touched (about twice "
           "as many), exchanges them, and waits for DDP's all-reduce of the other parameters inside the backward "
           "pass: " if profile else "")
        + "a second process cannot pay for it. On a CPU machine zhflow therefore trains fastText in one process with "
        "every core's threads unless `train.nproc` says otherwise: the `worker, 1 process` row is what a default run gets.",
        "",
    ])
