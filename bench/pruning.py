"""Pruning: every method and amount, fine-tuned, against the unpruned model on the same test split.

One default-preset model (the default preset's family) is trained on the built-in corpus; each (method, amount) prunes a copy with
training/prune.py, fine-tunes it with the same worker the pipeline uses, and is scored on the test
split. Latency is measured for all models in turn (interleaved), ``repeats`` times; the median p50/p95
is reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common import quick_size, verdict
from training.checkpoint import save_checkpoint
from training.job import WorkerJob
from training.presets import preset
from training.data.prepare import prepare_dataset
from training.evaluate import load_model, open_split, split_macro_f1
from training.models import family_of
from training.measure import latency
from training.prune import prune, sparsity
from training.events import read_result

# (method, amount, rounds): rounds > 1 is the iterative schedule (cubic), one fine-tune epoch per round
FULL = [("structured", 0.3, 1), ("structured", 0.5, 1), ("structured", 0.7, 1), ("structured", 0.7, 3),
        ("global_unstructured", 0.5, 1), ("global_unstructured", 0.8, 1), ("global_unstructured", 0.8, 3),
        ("global_unstructured", 0.9, 3), ("l1_unstructured", 0.5, 1), ("l1_unstructured", 0.8, 3)]
QUICK = [("structured", 0.5, 1), ("global_unstructured", 0.8, 3)]
TARGETS = {("structured", 0.5, 1): "F1 within 1 point, batch-64 at least 1.5x faster, file at least 1.8x smaller",
           ("global_unstructured", 0.8, 3): "F1 within 1 point, file at least 3x smaller"}
NONE = ("none", 0.0, 0)


def _worker(job: WorkerJob, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(job.model_dump_json())
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    subprocess.run([sys.executable, "-m", "training.worker", "--config", str(out / "job.json")], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return read_result(out)


def _test_f1(checkpoint: str, prepared: Path, max_len: int) -> float:
    model, cfg, _ = load_model(checkpoint)
    return split_macro_f1(model, cfg, prepared, "test", max_len)


def _schedule_note(results: dict, ref: dict) -> str:
    one, three = results.get(("global_unstructured", 0.8, 1)), results.get(("global_unstructured", 0.8, 3))
    if not one or not three:
        return ""
    return (f" 80% global sparsity in one round changes macro-F1 by {100 * (one['f1'] - ref['f1']):+.2f} points; reached in "
            f"3 rounds, by {100 * (three['f1'] - ref['f1']):+.2f} (`prune.rounds`).")


def run(quick: bool, repeats: int) -> str:
    cfg = preset("default")
    if quick:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_samples": quick_size(2000, 400)}),
                                     "train": cfg.train.model_copy(update={"epochs": quick_size(2, 1)})})
    finetune = cfg.train.model_copy(update={"epochs": cfg.prune.finetune_epochs, "lr": cfg.prune.finetune_lr,
                                            "patience": cfg.prune.finetune_epochs})
    max_len = cfg.preprocess.max_len
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        prepared = tmp / "prepared"
        manifest = prepare_dataset(cfg.data, cfg.preprocess, prepared)
        base = dict(prepared_dir=str(prepared), max_len=max_len)
        trained = _worker(WorkerJob(stage="train", model=cfg.model, train=cfg.train, out_dir=str(tmp / "train"), **base), tmp / "train")
        models = {NONE: trained["best_checkpoint"]}
        for method, amount, rounds in (QUICK if quick else FULL):
            checkpoint = trained["best_checkpoint"]
            schedule = cfg.prune.model_copy(update={"amount": amount, "rounds": rounds})
            for round_no, round_amount in enumerate(schedule.round_amounts(), 1):  # as the pipeline's prune rounds do
                model, model_cfg, state = load_model(checkpoint)
                model, small = prune(model, model_cfg, method, round_amount, cfg.prune.include_embedding, reference=cfg.model)
                out = tmp / f"{method}-{amount}-{rounds}" / str(round_no)
                save_checkpoint(out / "pruned.pt", {**state, "model": model.state_dict(), "model_config": small.model_dump(),
                                                     "sizes": family_of(small).sizes_of(model, state["sizes"])})
                checkpoint = _worker(WorkerJob(stage="finetune", model=small, train=finetune, out_dir=str(out),
                                               init_checkpoint=str(out / "pruned.pt"), keep_sparsity=method != "structured", **base),
                                     out)["best_checkpoint"]
            models[(method, amount, rounds)] = checkpoint

        results = {}
        for key, ckpt in models.items():
            model, model_cfg, _ = load_model(ckpt)
            stats = sparsity(model)
            results[key] = {"f1": _test_f1(ckpt, prepared, max_len), "params": stats["params"],
                            "nonzero": stats["nonzero_params"], "bytes": os.path.getsize(ckpt), "lat": []}
        loaded = {key: load_model(ckpt) for key, ckpt in models.items()}
        for _ in range(repeats):  # interleaved: every model once per repeat
            for key, (model, model_cfg, state) in loaded.items():
                test = open_split(prepared, "test", model_cfg, max_len, state["sizes"])
                results[key]["lat"].append(latency(model, test, threads=1))

    def med(key, name):
        return float(np.median([m[name] for m in results[key]["lat"]]))

    ref = results[NONE]
    rows, findings = [], []
    for key, r in results.items():
        method, amount, rounds = key
        rows.append(
            f"| {method} | {100 * amount:.0f}% | {rounds} | {r['f1']:.4f} | {100 * (r['f1'] - ref['f1']):+.2f} | {r['params']:,.0f} | "
            f"{r['nonzero']:,.0f} | {r['bytes'] / 1e3:,.0f} kB ({ref['bytes'] / r['bytes']:.2f}x) | "
            f"{med(key, 'latency_b1_p50_ms'):.2f} / {med(key, 'latency_b1_p95_ms'):.2f} | "
            f"{med(key, 'latency_b64_p50_ms'):.1f} / {med(key, 'latency_b64_p95_ms'):.1f} "
            f"({med(NONE, 'latency_b64_p50_ms') / med(key, 'latency_b64_p50_ms'):.2f}x) |")
    for key, target in TARGETS.items():
        if key not in results:
            continue
        r = results[key]
        drop = 100 * (ref["f1"] - r["f1"])
        size = ref["bytes"] / r["bytes"]
        speed = med(NONE, "latency_b64_p50_ms") / med(key, "latency_b64_p50_ms")
        ok = drop <= 1 and (size >= 1.8 and speed >= 1.5 if key[0] == "structured" else size >= 3)
        findings.append(f"- {key[0]} {100 * key[1]:.0f}% in {key[2]} round(s) of prune + {cfg.prune.finetune_epochs} fine-tune "
                        f"epoch(s) (target: {target}): macro-F1 {-drop:+.2f} points, file {size:.2f}x smaller, "
                        f"batch-64 {speed:.2f}x faster: {verdict(ok)}.")
    n = manifest["splits"]
    return "\n".join([
        "## Pruning",
        "",
        f"A default-preset {cfg.model.name} model (at most {cfg.train.epochs} epochs) trained on {n['train']['n']:,} texts of the built-in corpus, "
        f"pruned by each method and amount (embeddings included) in one round or in 3 (the iterative schedule, "
        f"{cfg.prune.schedule}), each round fine-tuned {cfg.prune.finetune_epochs} epoch(s) at "
        f"lr {cfg.prune.finetune_lr} by the pipeline's worker, scored on the same {n['test']['n']:,} test texts. "
        f"File: the checkpoint as stored (zeros as a bitmap). Latency: forward pass on encoded test texts, 1 thread, "
        f"after warm-up, median over {repeats} interleaved measurements of p50 / p95 (ms).",
        "",
        "| method | amount | rounds | test macro-F1 | change (points) | parameters | non-zero | file | batch 1 p50 / p95 | batch 64 p50 / p95 (speed-up) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *findings,
        "",
        "Unstructured zeros make the file smaller but not the dense forward pass faster (PyTorch's CPU kernels do the "
        "same multiplications); structured pruning removes the work itself. The pruned models were trained for one "
        "fine-tune epoch per round more than the unpruned one: a small gain (a positive change) is that extra "
        "training, not the pruning." + _schedule_note(results, ref),
        "",
    ])
