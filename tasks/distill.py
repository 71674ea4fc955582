"""The distill stage: the teachers' probabilities (computed once per teacher and prepared folder, cached), the
student trained on them by the same DDP worker, and teacher, student alone and distilled student side by side.

MLflow: a nested ``distill`` run (the settings, the teachers, the comparison table and metrics) holding the
student's ``train_student`` and ``evaluate_student`` runs (and ``train_alone`` / ``evaluate_alone`` when the run has
no comparable student trained without a teacher).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import mlflow
import numpy as np
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import CacheKeyFnPolicy
from sklearn.metrics import accuracy_score, f1_score

import training.distill
from training.config import DistillConfig, PipelineConfig, flatten
from training.data.prepare import load_manifest
from training.distill import DistillError, baseline_teacher, check_teacher_labels, pyfunc_teacher, served_labels, transfer_texts
from training.inference import serving_precision
from training.measure import measure_checkpoint
from tasks.register import served_classifier
from tasks.train import hard_timeout, launch_worker
from tasks.tracking import stage_run, work_root

SPLITS = ("train", "val", "test")


def _code_digest() -> str:
    return hashlib.sha256(Path(training.distill.__file__).read_bytes()).hexdigest()[:12]


def _uri_identity(uri: str) -> str:
    """What a model URI points at now (an alias moves: the version it names is the teacher)."""
    info = mlflow.models.get_model_info(uri)
    return f"{info.run_id}/{info.artifact_path}/{info.model_uuid}"


def teacher_identity(teacher: str, trained_checkpoint: str | None, config: PipelineConfig) -> str:
    """The teacher's content address: the checkpoint's digest, the baseline's settings, or the model a URI names."""
    if teacher == "trained":
        return "trained:" + json.loads(Path(trained_checkpoint + ".json").read_text())["sha256"]
    if teacher == "baseline":
        return f"baseline:folds={config.distill.teacher_folds}:seed={config.data.seed}:code={_code_digest()}"
    return f"uri:{_uri_identity(teacher)}:code={_code_digest()}"


def check_teachers(distill: DistillConfig, labels: list[str] | None = None) -> None:
    """Model-URI teachers that can be loaded and (``labels`` given) predict this data's labels, read from their
    signatures; DistillError naming the teacher otherwise. Before any training."""
    if not distill.enabled:
        return
    for teacher in distill.teacher:
        if teacher in ("trained", "baseline"):
            continue
        try:
            info = mlflow.models.get_model_info(teacher)
        except (MlflowException, OSError) as err:
            raise DistillError(f"distill.teacher {teacher}: cannot load it: {str(err).splitlines()[0][:300]}") from None
        if labels is not None and info.signature is not None and info.signature.outputs is not None:
            check_teacher_labels(teacher, served_labels(info.signature.outputs.input_names()), labels)


def transfer_digest(prepared_dir: str) -> str:
    """The digest of what a teacher reads in a prepared folder: its label order and every split's texts (as served and
    cleaned) and labels, row by row. Two folders of the same texts (another student's sizes, say) share the teacher's
    probabilities instead of labelling the same texts again (a transformer teacher: half an hour)."""
    h = hashlib.sha256(json.dumps(load_manifest(prepared_dir)["labels"], ensure_ascii=False).encode())
    for split in SPLITS:
        frame = transfer_texts(prepared_dir, split)
        for column in ("text", "clean"):
            h.update("\0".join(frame[column]).encode() + b"\1")
        h.update(np.load(Path(prepared_dir) / f"{split}.labels.npy").astype(np.int64).tobytes() + b"\2")
    return h.hexdigest()


def _teacher_cache_key(ctx, params: dict) -> str:
    return "zhflow-teacher-" + hashlib.sha256(f"{params['identity']}|{params['texts']}".encode()).hexdigest()[:32]


class _Labelling:
    """A served teacher's labelling of the transfer set, shown as it goes: a line in the log every ``every_s`` seconds
    (texts done, texts/s, time left) and a progress artifact in the Prefect UI. A transformer teacher over a transfer
    set of augmented copies and word spans (200,000 texts, say) labels for half an hour; silent, it looks hung."""

    def __init__(self, teacher: str, total: int, every_s: float = 30.0):
        self.teacher, self.total, self.every_s = teacher, max(total, 1), every_s
        self.done, self.start = 0, time.monotonic()
        self.shown = self.start
        self.logger = get_run_logger()
        self.artifact = create_progress_artifact(progress=0.0, key="teacher-progress",
                                                 description=f"teacher {teacher}: texts labelled")

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.shown < self.every_s and self.done < self.total:
            return
        self.shown = now
        rate = self.done / max(now - self.start, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        self.logger.info(f"teacher {self.teacher}: {self.done:,}/{self.total:,} texts labelled "
                         f"({100 * self.done / self.total:.0f}%), {rate:,.0f} texts/s, about {left / 60:.0f} min left")
        update_progress_artifact(self.artifact, progress=round(100 * self.done / self.total, 1))


def _served(predict, teacher: str, prepared_dir: str, labels: list[str]) -> dict[str, np.ndarray]:
    """A served teacher's probabilities for every split's texts, its progress shown as it labels."""
    texts = {split: transfer_texts(prepared_dir, split)["text"].tolist() for split in SPLITS}
    progress = _Labelling(teacher, sum(map(len, texts.values())))
    return {split: pyfunc_teacher(predict, teacher, texts[split], labels, progress=progress) for split in SPLITS}


@task(name="teacher-probabilities", persist_result=True, cache_policy=CacheKeyFnPolicy(cache_key_fn=_teacher_cache_key))
def teacher_probabilities(teacher: str, identity: str, prepared_dir: str, texts: str, out_dir: str,
                          config: PipelineConfig, trained_checkpoint: str | None = None,
                          teacher_dir: str | None = None) -> dict:
    """One teacher's probabilities for every row of each split of the student's folder ``prepared_dir`` (train: the
    transfer set), saved as .npy in ``out_dir``; cached on (teacher identity, the folder's ``transfer_digest``
    ``texts``): a second run with the same teacher and texts reads them. ``teacher_dir``: the folder the trained
    teacher was trained on (its vocabularies)."""
    manifest = load_manifest(prepared_dir)
    labels = manifest["labels"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info: dict = {"teacher": teacher}
    probs: dict[str, np.ndarray] = {}
    if teacher == "trained":  # served as it will be: its own vocabularies (those of the folder it was trained on)
        with tempfile.TemporaryDirectory() as tmp:
            classifier, _ = served_classifier(config, {"kind": "neural", "checkpoint": trained_checkpoint},
                                              {"path": teacher_dir}, Path(tmp))
            # and in the precision its registration would choose: bf16 where the CPU has it, it agrees with fp32 and is
            # faster, checked on validation texts (m3e-small on an AMD EPYC with AVX-512 bf16: 1.75x the texts/s of fp32)
            info["precision"], measured = serving_precision(classifier, transfer_texts(prepared_dir, "val")["text"].tolist()[:512])
            info |= {k: round(v, 4) for k, v in measured.items()}
            probs = _served(lambda frame: classifier.predict(None, frame), teacher, prepared_dir, labels)
    elif teacher == "baseline":
        y = np.load(Path(prepared_dir) / "train.labels.npy")
        probs["train"], info_fit, fitted = baseline_teacher(prepared_dir, y, len(labels), config.distill.teacher_folds,
                                                             config.data.seed)
        info |= info_fit
        for split in ("val", "test"):
            probs[split] = fitted.predict_proba(transfer_texts(prepared_dir, split)["clean"].tolist()).astype(np.float32)
    else:
        probs = _served(mlflow.pyfunc.load_model(teacher).predict, teacher, prepared_dir, labels)
    paths = {}
    for split, p in probs.items():
        paths[split] = str(out / f"{split}.npy")
        np.save(paths[split], p)
    return {"paths": paths, "info": info, "identity": identity}


def _scores(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    pred = probs.argmax(1)
    return {"macro_f1": float(f1_score(labels, pred, average="macro")), "accuracy": float(accuracy_score(labels, pred))}


@task(name="teachers")
def teachers(config: PipelineConfig, prepared: dict, parent: dict, trained_checkpoint: str | None,
             teacher_prepared: dict | None = None) -> dict:
    """Every teacher's probabilities for the student's folder ``prepared`` (cached), averaged; their scores on val and
    test. ``teacher_prepared``: the folder the trained teacher learnt from (default ``prepared``)."""
    logger = get_run_logger()
    labels = load_manifest(prepared["path"])["labels"]
    check_teachers(config.distill, labels)
    root = work_root() / "teachers"
    texts = transfer_digest(prepared["path"])
    got = []
    for teacher in config.distill.teacher:
        identity = teacher_identity(teacher, trained_checkpoint, config)
        key = _teacher_cache_key(None, {"identity": identity, "texts": texts})
        folder = root / key
        fresh = not all((folder / f"{s}.npy").is_file() for s in SPLITS)  # the files are gone: the cache entry is stale
        state = teacher_probabilities.with_options(refresh_cache=fresh)(
            teacher, identity, prepared["path"], texts, str(folder), config, trained_checkpoint,
            (teacher_prepared or prepared)["path"], return_state=True)
        result = state.result()
        got.append(result | {"cached": state.name == "Cached"})
        logger.info("teacher %s: probabilities %s", teacher, "from the cache" if state.name == "Cached" else "computed")
    work = Path(parent["work_dir"]) / "teacher"
    work.mkdir(parents=True, exist_ok=True)
    averaged, scores = {}, {}
    for split in SPLITS:
        averaged[split] = str(work / f"{split}.npy")
        np.save(averaged[split], np.mean([np.load(g["paths"][split]) for g in got], axis=0).astype(np.float32))
        if split != "train":
            y = np.load(Path(prepared["path"]) / f"{split}.labels.npy")
            scores |= {f"{split}_{k}": v for k, v in _scores(np.load(averaged[split]), y).items()}
    return {"paths": averaged, "scores": scores,
            "teachers": [g["info"] | {"cached": g["cached"], "identity": g["identity"]} for g in got]}


@task(name="train_student")
def train_student(config: PipelineConfig, prepared: dict, parent: dict, teacher_probs: str | None,
                  stage: str = "train_student", cpus: int | None = None, gpus: list[int] | None = None) -> dict:
    """The student (``distill.student``, trained as ``distill.train``) by the DDP worker; with ``teacher_probs`` on the
    distillation loss, without it on the labels alone (the student trained alone, for the comparison)."""
    d = config.distill
    with stage_run(parent, stage) as run:
        extra = {"teacher_probs": teacher_probs, "temperature": d.temperature, "alpha": d.alpha} if teacher_probs else {}
        if teacher_probs:
            mlflow.log_params({"distill.temperature": d.temperature, "distill.alpha": d.alpha})
        return launch_worker(stage, config, prepared, run.info.run_id, Path(parent["work_dir"]) / stage,
                             cpus=cpus, gpus=gpus, model=d.student, train=d.train,
                             epochs_setting="distill.train.epochs", **extra)


def distil(config: PipelineConfig, prepared: dict, parent: dict, trained_checkpoint: str | None,
           cpus: int | None = None, gpus: list[int] | None = None) -> tuple[dict, dict, dict]:
    """The student's data (``prepared``, or with ``distill.augment_copies``, ``span_copies`` or ``unlabelled`` a folder
    of its own with those texts in train), the teachers' probabilities of it, and the distilled student trained on them: what the pipeline and a
    sweep trial share."""
    from tasks.preprocess import preprocess
    from training.models import tokenizer_source

    student_data, d = prepared, config.distill
    if d.augment_copies or d.unlabelled or d.span_copies:  # the transfer set: the same splits, more texts in train
        augment = config.augment.model_copy(update={"enabled": True, "n_aug": d.augment_copies}) if d.augment_copies else config.augment
        student_data = preprocess(config.data, config.preprocess, augment, parent, tokenizer_source(config.model),
                                  stage="preprocess_transfer", unlabelled=d.unlabelled, spans=d.span_copies)
    teacher = teachers(config, student_data, parent, trained_checkpoint, prepared)
    student = train_student.with_options(timeout_seconds=hard_timeout(config.distill.train.timeout_minutes),
                                         retries=config.distill.train.task_retries, retry_delay_seconds=5)(
        config, student_data, parent, teacher["paths"]["train"], cpus=cpus, gpus=gpus)
    return student_data, teacher, student


def comparable(config: PipelineConfig) -> bool:
    """Whether the run's own neural model is the student trained alone: the same family, sizes and training."""
    return config.model == config.distill.student and config.train == config.distill.train


COMPARED = ("test_macro_f1", "test_accuracy", "val_macro_f1", "params", "file_bytes",
            "latency_b1_p50_ms", "latency_b1_p95_ms", "latency_b64_p50_ms", "latency_b64_p95_ms")


@task(name="distill-report")
def distill_report(config: PipelineConfig, prepared: dict, distill_parent: dict, teacher: dict, trained: dict | None,
                   alone: dict, distilled: dict) -> dict:
    """Teacher, student alone and distilled student side by side on the same test split, in the distill run (metrics
    ``{teacher,alone,distilled}_*``, ``comparison.md``) and as a Prefect artifact; the run is ended."""
    threads = config.prune.latency_threads
    rows = {"teacher": {k: teacher["scores"][k] for k in ("test_macro_f1", "test_accuracy", "val_macro_f1")}}
    if config.distill.teacher == ["trained"] and trained is not None:  # a model zhflow can time like the students
        rows["teacher"] |= _cost(trained["best_checkpoint"], prepared, config, threads)
    for name, evaluated in (("alone", alone), ("distilled", distilled)):
        rows[name] = {k: evaluated["metrics"][k] for k in ("test_macro_f1", "test_accuracy", "val_macro_f1")}
        rows[name] |= _cost(evaluated["checkpoint"], {"path": evaluated.get("prepared_dir") or prepared["path"]}, config, threads)
    metrics = {f"{name}_{k}": float(v) for name, row in rows.items() for k, v in row.items()}
    if "latency_b64_p50_ms" in rows["teacher"]:
        metrics["speedup_b64_vs_teacher"] = rows["teacher"]["latency_b64_p50_ms"] / rows["distilled"]["latency_b64_p50_ms"]
    metrics["distilled_minus_alone_test_macro_f1"] = rows["distilled"]["test_macro_f1"] - rows["alone"]["test_macro_f1"]
    titles = {"teacher": f"teacher ({' + '.join(config.distill.teacher)})",
              "alone": f"{config.distill.student.name} alone", "distilled": f"{config.distill.student.name} distilled"}

    def cell(row, key, fmt):
        return format(row[key], fmt) if key in row else "-"

    table = ["| model | test macro-F1 | test accuracy | val macro-F1 | parameters | file | latency b1 p50 / p95 | latency b64 p50 / p95 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        size = f"{row['file_bytes'] / 1e6:.2f} MB" if "file_bytes" in row else "-"
        table.append(f"| {titles[name]} | {cell(row, 'test_macro_f1', '.4f')} | {cell(row, 'test_accuracy', '.4f')} | "
                     f"{cell(row, 'val_macro_f1', '.4f')} | {cell(row, 'params', ',.0f')} | {size} | "
                     f"{cell(row, 'latency_b1_p50_ms', '.2f')} / {cell(row, 'latency_b1_p95_ms', '.2f')} ms | "
                     f"{cell(row, 'latency_b64_p50_ms', '.2f')} / {cell(row, 'latency_b64_p95_ms', '.2f')} ms |")
    text = ("\n".join(table) + f"\n\nSame test split; latency: the forward pass on {threads} CPU thread(s). "
            f"T = {config.distill.temperature}, alpha = {config.distill.alpha}.\n")
    client = mlflow.MlflowClient()
    run_id = distill_parent["run_id"]
    now = int(time.time() * 1000)
    params = {k: str(v) for k, v in flatten(config.distill, "distill.").items() if not k.startswith(("distill.train.", "distill.student."))}
    params |= {k: str(v) for k, v in flatten(config.distill.student, "distill.student.").items()}
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
                     params=[Param(k, v[:6000]) for k, v in params.items()],
                     tags=[RunTag("teachers", json.dumps(teacher["teachers"], ensure_ascii=False)[:5000])])
    client.log_text(run_id, text, "comparison.md")
    client.set_terminated(run_id, "FINISHED")
    create_markdown_artifact(text, key="distillation", description="teacher, student alone and distilled student")
    get_run_logger().info("distillation: %s", "; ".join(f"{titles[n]} test macro-F1 {r['test_macro_f1']:.4f}" for n, r in rows.items()))
    return {"metrics": metrics, "rows": rows, "run_id": run_id}


def _cost(checkpoint: str, prepared: dict, config: PipelineConfig, threads: int) -> dict[str, float]:
    measured = measure_checkpoint(checkpoint, prepared["path"], config.preprocess.max_len, threads)
    return {"params": measured["params"], "file_bytes": measured["file_bytes"],
            **{k: v for k, v in measured.items() if k.startswith("latency_")}}
