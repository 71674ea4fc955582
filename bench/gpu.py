"""On a CUDA GPU: the paths that only a GPU takes, run end to end and timed.

    python -m bench --only gpu          # as a section of BENCHMARKS.md
    python -m bench.gpu --out FILE      # the same, standalone: needs torch, transformers, pydantic, jieba, no MLflow

Every model family's worker on CUDA (bf16 autocast, zhflow's default there), the pretrained family at fp32, bf16 and
fp16 (autocast with a gradient scaler), an fp16 run whose only process is SIGKILLed and resumed by torchrun, and MLM
pretraining under DDP and FSDP2 (nccl) with bf16 and fp16, FSDP2 killed and resumed from its sharded checkpoint, and a
BERT-base-shaped encoder's tokens/s (12 layers x 768). Each run is the worker as ``zhflow run`` / ``zhflow pretrain`` start it
(``torchrun -m training.worker`` / ``training.mlm``), without Prefect and MLflow around it. A GPU machine with one GPU
runs one process per run: nccl refuses two ranks on one GPU, so the exchange between GPUs is not exercised by it.
``--dry-run`` runs the same on the CPU at the smallest sizes (fp16 left out), to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.pretrain import BIG, SMALL, _config_file, _worker_error, prepare, pretrain, write_lines
from bench.pretrained import build_encoder
from training.data.prepare import prepare_dataset
from training.distributed import torchrun_env
from training.events import read_result
from training.job import WorkerJob
from training.presets import preset

FLOOR = 0.70  # validation macro-F1 that a model which learned nothing (0.33-0.5 on two classes) cannot reach
FAMILIES = ("fasttext", "textcnn", "bilstm", "transformer")


def environment() -> str:
    if not torch.cuda.is_available():
        return f"no CUDA device; torch {torch.__version__} on the CPU"
    p = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return (f"{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, nccl {nccl}")


def worker(prepared: Path, cfg, tmp: Path, restarts: int = 0, env: dict | None = None, **train) -> dict:
    """One training run of the classifier worker under torchrun, one process; its result and wall time."""
    out = tmp / f"w-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    job = WorkerJob(stage="train", prepared_dir=str(prepared), out_dir=str(out), model=cfg.model, max_len=cfg.preprocess.max_len,
                    train=cfg.train.model_copy(update={"max_restarts": restarts, **train}))
    (out / "job.json").write_text(job.model_dump_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts",
           str(restarts), "-m", "training.worker", "--config", str(out / "job.json")]
    started = time.perf_counter()
    run = subprocess.run(cmd, env={k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"} | torchrun_env(1) | (env or {}),
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"worker failed ({run.returncode}): {run.stdout[-2000:]}{_worker_error(run.stderr)}")
    return {**read_result(out), "seconds": time.perf_counter() - started, "log": run.stdout}


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


PARTS = ("families", "pretrained", "pretraining", "large")


def run(quick: bool = False, repeats: int = 1, dataset: str | None = None, dry_run: bool = False,
        parts: tuple[str, ...] = PARTS) -> str:
    if not torch.cuda.is_available() and not dry_run:
        return "## GPU\n\nNo CUDA device on this machine: the section runs only where there is one (or with --dry-run).\n"
    lines: list[str] = []

    def note(*rows: str) -> None:  # shown as it goes: a run cut short still says how far it got
        lines.extend(rows)
        print(*rows, sep="\n", flush=True)

    note("## GPU", "", f"Device: {environment()}.", "")
    memory = "GPU memory allocated" if torch.cuda.is_available() else "resident memory"
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        base = preset("default", "fasttext")
        data = base.data.model_copy(update={"max_samples": 600 if dry_run else 6000, **({"dataset": dataset} if dataset else {})})
        prepare_dataset(data, base.preprocess, tmp / "plain")
        epochs = 1 if dry_run else 3

        # ---- every from-scratch family on CUDA ---------------------------------------------------------------------
        note("### Every family's worker", "",
             f"Default preset, {data.max_samples} texts of the dataset (split as `zhflow run` splits them), {epochs} "
             "epoch(s), `train.precision=auto` (bf16 autocast on CUDA), one process.", "",
             "| family | samples/s (last epoch) | best validation macro-F1 | wall (s) | check |", "|---|---|---|---|---|")
        for fam in FAMILIES if "families" in parts else ():
            cfg = preset("default", fam).model_copy(update={"data": data})
            try:
                r = worker(tmp / "plain", cfg, tmp, epochs=epochs, patience=epochs)
                ok = r["best_val_macro_f1"] >= FLOOR or dry_run
                note(_row([fam, f"{r['epoch_samples_per_second'][-1]:,.0f}", f"{r['best_val_macro_f1']:.4f}",
                          f"{r['seconds']:.0f}", "ok" if ok else f"**below {FLOOR}**"]))
                failures += [] if ok else [f"{fam}: validation macro-F1 {r['best_val_macro_f1']:.4f}"]
            except Exception as e:  # noqa: BLE001 - the table says which run failed and why; the others still run
                note(_row([fam, "-", "-", "-", f"**failed**: {str(e)[-300:]}".replace("\n", " ")]))
                failures.append(f"{fam}: {e}")
        note("")

        # ---- the pretrained family: fp32, bf16, fp16 -----------------------------------------------------------------
        chars = json.loads((tmp / "plain" / "char_vocab.json").read_text(encoding="utf-8"))
        layers, width = (2, 64) if dry_run else (4, 256)
        source = build_encoder(tmp / "encoder", chars, layers, width)
        ft = preset("default", "pretrained")
        pre = ft.preprocess.model_copy(update={"max_len": 128})
        prepare_dataset(data, pre, tmp / "tok", tokenizer=str(source))
        ft = ft.model_copy(update={"data": data, "preprocess": pre, "model": ft.model.model_copy(update={"pretrained": str(source)})})
        precisions = ("fp32", "bf16") if dry_run else ("fp32", "bf16", "fp16")
        note("### The pretrained family", "",
             f"A randomly initialised {layers}-layer, {width}-wide BERT (no checkpoint can be downloaded here) with a "
             f"WordPiece vocabulary of the dataset's characters, fine-tuned {epochs} epoch(s) at lr 1e-4, batch "
             f"{ft.train.batch_size}, sequences of up to 128 tokens. The last row kills the only process (SIGKILL) "
             "five optimiser steps into epoch 2: torchrun restarts it and it resumes from epoch 1's checkpoint, "
             "gradient scaler included.", "",
             "| precision | samples/s (last epoch) | best validation macro-F1 | restarts | wall (s) | check |",
             "|---|---|---|---|---|---|")
        rates = {}
        n_train = json.loads((tmp / "tok" / "manifest.json").read_text())["splits"]["train"]["n"]
        kill_at = -(-n_train // ft.train.batch_size) + 5  # in epoch 2: it resumes from epoch 1's checkpoint
        runs = [(p, {}) for p in precisions] + [(f"{precisions[-1]}, killed at step {kill_at}", {"kill": True})]
        for label, how in runs if "pretrained" in parts else ():
            precision = label.split(",")[0]
            env, restarts = {}, 0
            if how.get("kill"):
                env = {"ZHFLOW_TEST_KILL_AT_STEP": str(kill_at), "ZHFLOW_TEST_KILL_ONCE_FILE": str(tmp / f"killed-{precision}")}
                restarts = 1
            try:
                runs_for = max(epochs, 2) if how.get("kill") else epochs  # the kill falls in epoch 2
                r = worker(tmp / "tok", ft, tmp, restarts=restarts, env=env, epochs=runs_for, patience=runs_for, lr=1e-4,
                           precision=precision)
                ok = (r["best_val_macro_f1"] >= FLOOR or dry_run) and r["restarts"] == restarts
                rate = r["epoch_samples_per_second"][-1]
                rates.setdefault(precision, rate)
                note(_row([label, f"{rate:,.0f}", f"{r['best_val_macro_f1']:.4f}", r["restarts"], f"{r['seconds']:.0f}",
                          "ok" if ok else "**failed**"]))
                if not ok:
                    failures.append(f"pretrained {label}: F1 {r['best_val_macro_f1']:.4f}, restarts {r['restarts']}")
            except Exception as e:  # noqa: BLE001
                note(_row([label, "-", "-", "-", "-", f"**failed**: {str(e)[-300:]}".replace("\n", " ")]))
                failures.append(f"pretrained {label}: {e}")
        if "fp32" in rates and "bf16" in rates:
            note("", f"bf16 / fp32 training throughput: {rates['bf16'] / rates['fp32']:.2f}x"
                     + (f"; fp16 / fp32: {rates['fp16'] / rates['fp32']:.2f}x." if "fp16" in rates else "."))
        note("")

        # ---- pretraining --------------------------------------------------------------------------------------------
        texts = _texts(tmp / "plain")
        n = 400 if dry_run else 8000
        prepare([write_lines(tmp / "c.txt", texts, n)], tmp / "corpus", max_len=128, held_out=0.05)
        small = _config_file(tmp, "small", SMALL)
        note("### Pretraining (`training.mlm`)", "",
             f"MLM with whole-word masking, {n} lines, sequences of up to 128 tokens, batch 32, one epoch, one "
             f"process; the small encoder is {SMALL['num_hidden_layers']} layers x {SMALL['hidden_size']}. FSDP2 on "
             "one GPU shards over a mesh of one (the same code path as on several, no memory saved). The killed "
             "run loses its only process at step 40 and resumes from the sharded checkpoint "
             "(`torch.distributed.checkpoint`).", "",
             f"| run | tokens/s | held-out loss (a uniform guess: ln(vocabulary)) | peak {memory} (MB) | restarts | check |", "|---|---|---|---|---|---|")
        mlm_runs = {"ddp, fp32": ("ddp", "fp32", {}), "ddp, bf16": ("ddp", "bf16", {}), "fsdp, bf16": ("fsdp", "bf16", {}),
                    "fsdp, fp16": ("fsdp", "fp16", {}), "ddp, fp16": ("ddp", "fp16", {}),
                    "fsdp, bf16, killed at step 40": ("fsdp", "bf16", {"kill": True})}
        if dry_run:
            mlm_runs = {k: v for k, v in mlm_runs.items() if "fp16" not in k}
        if "pretraining-killed" in parts:
            mlm_runs, parts = {k: v for k, v in mlm_runs.items() if "killed" in k}, (*parts, "pretraining")
        for label, (strategy, precision, how) in mlm_runs.items() if "pretraining" in parts else ():
            env, restarts, extra = None, 0, {}
            if how.get("kill"):
                env = {"ZHFLOW_TEST_KILL_AT_STEP": "4" if dry_run else "40", "ZHFLOW_TEST_KILL_ONCE_FILE": str(tmp / "mlm-killed")}
                restarts, extra = 1, {"checkpoint_minutes": 1e-6}
            try:
                r = pretrain(tmp / "corpus", tmp, small, strategy, nproc=1, threads=os.cpu_count() or 1, max_len=128,
                             env=env, restarts=restarts, batch_size=32, precision=precision, **extra)
                held = r["heldout_loss"]
                from transformers import AutoModelForMaskedLM, AutoTokenizer

                AutoModelForMaskedLM.from_pretrained(r["export_dir"])  # the output loads outside zhflow
                chance = math.log(len(AutoTokenizer.from_pretrained(r["export_dir"])))  # a uniform guess's loss
                ok = held == held and held < chance and r["restarts"] == restarts
                note(_row([label, f"{r['tokens_per_second']:,.0f}", f"{held:.3f}", f"{max(r['peak_memory_mb']):,.0f}",
                          r["restarts"], "ok" if ok else "**failed**"]))
                if not ok:
                    failures.append(f"pretrain {label}: held-out loss {held}, restarts {r['restarts']}")
            except Exception as e:  # noqa: BLE001
                note(_row([label, "-", "-", "-", "-", f"**failed**: {str(e)[-300:]}".replace("\n", " ")]))
                failures.append(f"pretrain {label}: {e}")
        note("")

        # ---- a 110M-parameter encoder ---------------------------------------------------------------------------------
        shape = {**SMALL, "num_hidden_layers": 2} if dry_run else {**BIG, "num_hidden_layers": 12}
        big = _config_file(tmp, "big", shape)
        note(f"### A {shape['num_hidden_layers']}-layer, {shape['hidden_size']}-wide encoder", "",
             "The same corpus, batch 64, one epoch, bf16; DDP (one process: the plain model) against FSDP2.", "",
             f"| strategy | parameters | tokens/s | peak {memory} (MB) |", "|---|---|---|---|")
        for strategy in ("ddp", "fsdp") if "large" in parts else ():
            try:
                r = pretrain(tmp / "corpus", tmp, big, strategy, nproc=1, threads=os.cpu_count() or 1, max_len=128,
                             batch_size=64, precision="bf16")
                note(_row([strategy, f"{r['parameters']:,}", f"{r['tokens_per_second']:,.0f}", f"{max(r['peak_memory_mb']):,.0f}"]))
            except Exception as e:  # noqa: BLE001
                note(_row([strategy, "-", "-", f"**failed**: {str(e)[-300:]}".replace("\n", " ")]))
                failures.append(f"big {strategy}: {e}")
        note("")
    note("Every run passed its check." if not failures else "Failed: " + "; ".join(f[:400] for f in failures), "")
    return "\n".join(lines)


def _texts(prepared: Path) -> list[str]:
    """The cleaned texts of a prepared dataset's train split (the pretraining corpus: never validation or test)."""
    with open(prepared / "train.jsonl", encoding="utf-8") as f:
        return list(dict.fromkeys(json.loads(line)["clean"] for line in f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", help="a dataset file or built-in name (default: the built-in corpus)")
    parser.add_argument("--out", type=Path, help="write the section here too")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default: all)")

    parser.add_argument("--dry-run", action="store_true", help="on the CPU at the smallest sizes, to check the script")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    text = run(dataset=args.dataset, dry_run=args.dry_run, parts=tuple(args.parts.split(","))) + f"\n_{time.perf_counter() - started:.0f} s._\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0 if "Failed:" not in text else 1


if __name__ == "__main__":
    sys.exit(main())
