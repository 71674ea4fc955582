"""Registration task: log the pyfunc model, register it, move the ``champion`` alias only on a win.

The champion is compared on the *same* test split: when the current champion
was scored on another split, it is re-scored on this one before comparing, on
the texts of it that the champion never learnt from (each registration records
the digests of its train and val texts, as written and as cleaned), the new
model on the same texts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Iterator

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import infer_signature
from mlflow.tracking import MlflowClient
from prefect import get_client, get_run_logger, task
from prefect.concurrency.sync import concurrency
from sklearn.metrics import f1_score

import training
from training.config import BUILTIN_DATASETS, ModelConfig, PipelineConfig
from training.data.prepare import load_manifest
from training.inference import TextClassifier, serving_precision
from training.models import family_of
from tasks.schedule import SLOT_TAG
from tasks.tracking import stage_run, work_root

EXAMPLE = ["这本书非常好看，值得一读", "质量太差了，很失望"]
F1_TAG, SPLIT_TAG, LABELS_TAG, DATASET_TAG = "test_macro_f1", "test_content_digest", "zhflow.labels_digest", "zhflow.dataset"


def labels_digest(labels: list[str]) -> str:
    """Identifies a task's label set (order-free): models with different ones are never compared."""
    return hashlib.sha256(json.dumps(sorted(labels), ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def dataset_id(manifest: dict) -> str:
    """Which dataset a model learnt from: the built-in corpus's name, or the file's absolute path (its content may
    change from run to run: a nightly retrain on an updated file is the same task)."""
    name = manifest["dataset"]["name"]
    return name if name in BUILTIN_DATASETS else str(Path(name).resolve())[:5000]


def registered_name(config: PipelineConfig, manifest: dict) -> str:
    """``registry.model_name``, else one registered model per task, named from the dataset: ``zhflow-<name>``."""
    if config.registry.model_name:
        return config.registry.model_name
    dataset = manifest["dataset"]["name"]
    if dataset in BUILTIN_DATASETS:
        return f"zhflow-{dataset}"
    stem = Path(dataset).stem
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.").lower()[:80]
    if slug and slug == stem.lower():
        return f"zhflow-{slug}"
    # a name with characters beyond ASCII (评论.csv): the ASCII part and a short digest keep tasks apart
    return f"zhflow-{slug or 'dataset'}-{hashlib.sha256(stem.encode('utf-8')).hexdigest()[:6]}"


def _model_config(config: PipelineConfig, candidate: dict) -> ModelConfig:
    """The candidate's own model (a distilled student is not ``config.model``)."""
    return ModelConfig.model_validate(candidate["model"]) if candidate.get("model") else config.model


def _requirements(config: PipelineConfig, candidate: dict) -> list[str]:
    names = ["torch", "mlflow", "numpy", "pandas", "pydantic", "scikit-learn"]
    kind = candidate.get("kind", "neural")
    family = family_of(_model_config(config, candidate))
    if kind in ("neural", "ensemble"):
        names += family.requirements()
    if kind != "neural" or family.segments_words:  # the linear model and word-input families read jieba words
        names += ["jieba", "rjieba"] if config.preprocess.segmenter == "rjieba" else ["jieba"]
    if config.preprocess.traditional_to_simplified:
        names.append("opencc")
    return [f"{n}=={metadata.version(n)}" for n in names]


SEEN_TAG, SEEN_FILE = "zhflow.seen_texts_run", "seen_texts.npy"


def text_hashes(texts) -> np.ndarray:
    """8-byte digests of texts, in their order: a model's training texts recorded compactly (a million texts: 8 MB)."""
    return np.array([int.from_bytes(hashlib.blake2b(str(t).encode("utf-8"), digest_size=8).digest(), "little")
                     for t in texts], dtype=np.uint64)


def seen_texts(*prepared_dirs: str | Path) -> np.ndarray:
    """The digests of the texts a model of these prepared folders learnt from or was chosen on (train and val; a
    distilled student's transfer set too), each as written and as cleaned: a later run with other cleaning settings
    (traditional to simplified, numbers replaced) still finds them."""
    frames = [pd.read_json(Path(folder) / f"{split}.jsonl", lines=True, dtype=False)
              for folder in dict.fromkeys(map(str, prepared_dirs)) for split in ("train", "val")]
    return np.unique(text_hashes(pd.concat([f[column] for f in frames for column in ("text", "clean")])))


def _champion_seen(client: MlflowClient, version) -> np.ndarray | None:
    """The champion's train and val texts' digests, when its registration recorded them."""
    run_id = version.tags.get(SEEN_TAG)
    if not run_id:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return np.load(client.download_artifacts(run_id, SEEN_FILE, tmp))
        except (MlflowException, OSError):
            return None


def _champion_f1_on(client: MlflowClient, name: str, version, prepared: dict, digest: str,
                    new_labels=None) -> tuple[float | None, float | None, str]:
    """The champion's test macro-F1 on this run's test split, and the new model's where it changes: (champion's,
    the new model's or None for its own score, what the scores are on). On another split the champion is scored
    again, on the texts of this test split it never learnt from (its registration recorded which it saw): a model
    re-scored on texts it trained on would look better than it is and keep the alias for ever. ``new_labels``:
    the new model's labels for a list of texts, to score it on the same texts; (None, None, why) when none are left."""
    on = "test macro-F1 on this run's test split"
    if version.tags.get(SPLIT_TAG) == digest and F1_TAG in version.tags:
        return float(version.tags[F1_TAG]), None, on
    test = pd.read_json(Path(prepared["path"]) / "test.jsonl", lines=True, dtype=False)  # labels "0"/"1" stay strings
    seen, subset = _champion_seen(client, version), False
    if seen is None:
        on += f" (version {version.version} did not record its training texts: it may have learnt some of these)"
    else:
        unseen = ~(np.isin(text_hashes(test["clean"]), seen) | np.isin(text_hashes(test["text"]), seen))
        if not unseen.any():
            return None, None, f"every text of this run's test split was in version {version.version}'s training data"
        if not unseen.all():
            if new_labels is None:
                return None, None, (f"this run's test split holds texts version {version.version} learnt from, and "
                                    "the new model cannot be scored on the others here")
            test, subset = test[unseen], True
            on = (f"test macro-F1 on the {len(test)} of this run's {len(unseen)} test texts that version "
                  f"{version.version} never learnt from")
    predicted = mlflow.pyfunc.load_model(f"models:/{name}/{version.version}").predict(test[["text"]])
    champion = float(f1_score(test["label"], predicted["label"], average="macro"))
    ours = float(f1_score(test["label"], list(new_labels(test["text"].astype(str).tolist())), average="macro")) if subset else None
    return champion, ours, on


@contextmanager
def registry_lock(name: str) -> Iterator[None]:
    """An exclusive lock per registered model: a file lock on this machine and, with a Prefect server, a global
    concurrency limit of 1 (runs on other machines that share the server wait too)."""
    locks = work_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100]
    with open(locks / f"registry-{slug}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            if os.environ.get("PREFECT_API_URL"):
                limit = f"zhflow-registry-{slug}"
                with get_client(sync_client=True) as prefect:
                    prefect.upsert_global_concurrency_limit_by_name(limit, 1)
                # a lease of 60 s, renewed while this process lives: a killed holder frees the slot within a minute
                with concurrency(limit, occupy=1, timeout_seconds=600, lease_duration=60):
                    yield
            else:
                yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _move_alias_locked(client: MlflowClient, name: str, version: str, f1: float, digest: str, prepared: dict | None,
                       labels: str | None = None, dataset: str | None = None,
                       new_labels=None) -> tuple[str, str, float | None]:
    try:
        champion = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        champion = None
    champion_f1 = None
    if champion is None:
        alias, reason = "champion", "first model"
    elif labels is not None and (champion.tags.get(LABELS_TAG), champion.tags.get(DATASET_TAG, dataset)) != (labels, dataset):
        # another task's model under the same name (or one registered before label sets were recorded): its score
        # on this test split means nothing
        alias, reason = "challenger", (
            f"not compared: champion version {champion.version} of {name} was trained on another dataset or label set "
            "(or before zhflow recorded them); give each task its own registry.model_name (or leave it empty), or move "
            "the alias by hand")
    elif (scored := _champion_f1_on(client, name, champion, prepared, digest, new_labels))[0] is None:
        # no text of this test split that the champion never learnt from: no fair comparison
        alias, reason = "challenger", f"not compared with version {champion.version}: {scored[2]}; move the alias by hand"
    else:
        champion_f1, subset_f1, on = scored
        f1 = f1 if subset_f1 is None else subset_f1  # both on the same texts
        # the same unrounded numbers on both sides: a model that only equals the champion does not replace it
        same = f"{f1:.4f}" == f"{champion_f1:.4f}"  # 4 decimals, as the summary shows; the exact ones where those agree
        ours, theirs = (repr(f1), repr(champion_f1)) if same else (f"{f1:.4f}", f"{champion_f1:.4f}")
        if f1 > champion_f1:
            alias, reason = "champion", f"beats version {champion.version}: {on} {ours} > {theirs}"
        else:
            alias, reason = "challenger", f"does not beat version {champion.version}: {on} {ours} <= {theirs}"
    client.set_registered_model_alias(name, alias, version)
    return alias, reason, champion_f1


def move_alias(client: MlflowClient, name: str, version: str, f1: float, digest: str, prepared: dict | None = None,
               labels: str | None = None) -> tuple[str, str, float | None]:
    """Give ``version`` the alias ``champion`` if it beats the champion's test macro-F1 on the same test split (or there
    is none), else ``challenger``; under the registry lock, so that the check and the move are one step. A champion
    of another label set (``labels``: :func:`labels_digest`) is not compared: the version becomes ``challenger``."""
    with registry_lock(name):
        return _move_alias_locked(client, name, version, f1, digest, prepared, labels)


def version_for_slot(client: MlflowClient, name: str, slot: str):
    """The version a scheduled run already registered for this scheduled time, if any."""
    found = client.search_model_versions(f"name = '{name}' and tags.`{SLOT_TAG}` = '{slot}'")
    return found[0] if found else None


def _slot_taken(client: MlflowClient, name: str, slot: str | None, result: dict) -> dict | None:
    """The result of registering in ``slot`` when a version already holds it (in the active register run)."""
    earlier = version_for_slot(client, name, slot) if slot else None
    if earlier is None:
        return None
    get_run_logger().warning("scheduled slot %s already registered %s version %s: not registering another", slot, name,
                             earlier.version)
    mlflow.set_tags({"registered_model": name, "model_version": str(earlier.version), "alias_reason": f"slot {slot} already registered"})
    aliases = client.get_model_version(name, str(earlier.version)).aliases
    return {**result, "name": name, "version": str(earlier.version), "uri": f"models:/{name}/{earlier.version}",
            "alias": aliases[0] if aliases else None}


def _artifacts(config: PipelineConfig, candidate: dict, prepared: dict, manifest: dict, tmp: Path) -> dict[str, str]:
    """What the served model carries for this candidate (training.inference.TextClassifier reads it)."""
    kind = candidate.get("kind", "neural")
    meta = tmp / "meta.json"
    meta.write_text(json.dumps({"labels": manifest["labels"], "preprocess": config.preprocess.model_dump(), "kind": kind,
                                "weight": candidate.get("weight", 1.0 if kind == "neural" else 0.0)}, ensure_ascii=False))
    artifacts = {"meta": str(meta)}
    folder = Path(candidate.get("prepared_dir") or prepared["path"])  # a distilled student's own vocabularies
    if kind in ("neural", "ensemble"):
        checkpoint = tmp / "model.pt"
        shutil.copy(candidate["checkpoint"], checkpoint)
        shutil.copy(candidate["checkpoint"] + ".json", str(checkpoint) + ".json")
        # what the family needs to encode raw text (zhflow's vocabularies, or the model's own tokenizer)
        artifacts |= {"checkpoint": str(checkpoint), "checkpoint_sidecar": str(checkpoint) + ".json",
                      **family_of(_model_config(config, candidate)).served_artifacts(str(folder))}
    if kind in ("linear", "ensemble"):
        artifacts |= {"linear": candidate["linear_dir"], "vocab": str(folder / "vocab.json")}
    for key in ("user_dict", "stopwords_file"):
        if getattr(config.preprocess, key):
            artifacts[key] = getattr(config.preprocess, key)
    return artifacts


def served_classifier(config: PipelineConfig, candidate: dict, prepared: dict, tmp: Path) -> tuple[TextClassifier, dict]:
    """The candidate as it will be served (raw strings in), in this process; and its artifacts (written under ``tmp``)."""
    artifacts = _artifacts(config, candidate, prepared, load_manifest(prepared["path"]), tmp)
    classifier = TextClassifier()
    classifier.load_context(type("Ctx", (), {"artifacts": artifacts})())
    return classifier, artifacts


@task(name="register")
def register_model(config: PipelineConfig, evaluated: dict, prepared: dict, parent: dict, slot: str | None = None) -> dict:
    """Log the pyfunc model of candidate ``evaluated`` (neural, linear or ensemble: its ``kind``) and register it.
    ``slot`` (a scheduled run's ``DEPLOYMENT@TIME``): a version already registered for that slot (a retried or re-run
    scheduled run) is returned instead of registering a second one."""
    logger = get_run_logger()
    manifest = load_manifest(prepared["path"])
    name = registered_name(config, manifest)
    digest = manifest["splits"]["test"]["content_digest"]
    labels = labels_digest(manifest["labels"])
    f1 = evaluated["metrics"]["test_macro_f1"]
    kind = evaluated.get("kind", "neural")  # how it is served; the candidate's name says which model it is
    candidate = "distilled" if evaluated.get("teacher") else kind
    with stage_run(parent, "register") as run, tempfile.TemporaryDirectory() as tmp:
        if config.registry.enabled and (earlier := _slot_taken(MlflowClient(), name, slot, {"run_id": run.info.run_id, "kind": candidate})):
            return earlier  # checked again under the lock below; this only saves logging a model for nothing
        classifier, artifacts = served_classifier(config, evaluated, prepared, Path(tmp))
        # bf16 where this CPU runs it faster and its labels agree with fp32's on the test texts (checked here)
        test_texts = pd.read_json(Path(prepared["path"]) / "test.jsonl", lines=True, dtype=False)["text"].astype(str).tolist()[:256]
        precision, checked = serving_precision(classifier, test_texts)
        meta = json.loads(Path(artifacts["meta"]).read_text(encoding="utf-8"))
        Path(artifacts["meta"]).write_text(json.dumps(meta | {"precision": precision}, ensure_ascii=False), encoding="utf-8")
        mlflow.set_tag("serving_precision", precision)
        if checked:
            mlflow.log_metrics(checked)
        # an unnamed string column: a plain list of texts, a Series or a DataFrame (column "text") all work
        signature = infer_signature(EXAMPLE, classifier.predict(None, EXAMPLE))
        info = mlflow.pyfunc.log_model(
            name="model", python_model=str(Path(training.__file__).parent / "pyfunc_model.py"), artifacts=artifacts, signature=signature, input_example=EXAMPLE,
            pip_requirements=_requirements(config, evaluated), code_paths=[str(Path(training.__file__).parent)],
        )
        mlflow.set_tag("candidate", candidate)
        seen = Path(tmp) / SEEN_FILE  # which texts it learnt from: a later run on another split scores it on the others
        np.save(seen, seen_texts(prepared["path"], evaluated.get("prepared_dir") or prepared["path"]))
        mlflow.log_artifact(str(seen))
        result = {"name": name, "version": None, "uri": info.model_uri, "alias": None, "run_id": run.info.run_id, "kind": candidate}
        if not config.registry.enabled:
            return result
        client = MlflowClient()
        # repr: the exact float, so that the next run compares the same number (a rounded tag made ties "win")
        tags = ({F1_TAG: repr(float(f1)), SPLIT_TAG: digest, LABELS_TAG: labels, DATASET_TAG: dataset_id(manifest),
                 "candidate": candidate, "parent_run_id": parent["run_id"], SEEN_TAG: run.info.run_id}
                | {k: str(v) if not isinstance(v, float) else repr(v) for k, v in (evaluated.get("teacher") or {}).items()} | ({SLOT_TAG: slot} if slot else {}))
        with registry_lock(name):  # the slot check, the registration and the alias move are one step
            if earlier := _slot_taken(client, name, slot, result):
                return earlier
            # waits until the version is READY, so no alias ever points at a version still being created
            version = mlflow.register_model(info.model_uri, name, tags=tags).version
            alias, reason, champion_f1 = _move_alias_locked(
                client, name, str(version), f1, digest, prepared, labels, dataset_id(manifest),
                new_labels=lambda texts: classifier.predict(None, texts)["label"])
        if champion_f1 is not None:
            mlflow.log_metric("champion_test_macro_f1", champion_f1)
        mlflow.set_tags({"registered_model": name, "model_version": str(version), "alias": alias, "alias_reason": reason})
        (logger.warning if reason.startswith("not compared") else logger.info)(
            "registered %s version %s as %s: %s", name, version, alias, reason)
        return {**result, "version": str(version), "uri": f"models:/{name}/{version}", "alias": alias, "alias_reason": reason}
