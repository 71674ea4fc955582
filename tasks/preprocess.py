"""Preprocessing task: content-addressed and cached on (dataset digest, settings, files, code version)."""

from __future__ import annotations

import contextvars
import fcntl
import hashlib
import json
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlflow
import pandas as pd
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.exceptions import MlflowException
from prefect import get_run_logger, task
from prefect.cache_policies import CacheKeyFnPolicy
from prefect.locking.filesystem import FileSystemLockManager
from prefect.artifacts import create_markdown_artifact
from prefect.transactions import BaseTransaction

import training.data
import training.text
from training.config import AugmentConfig, DataConfig, PreprocessConfig
from training.data.prepare import MANIFEST, load_manifest, manifest_markdown, prepare_dataset
from training.data.readers import dataset_digest
from training.models import tokenizer_key
from training.text.segment import file_digest
from tasks.recover import owner, owner_gone
from tasks.tracking import stage_run, work_root


def code_version() -> str:
    """Digest of the preprocessing code itself: editing it invalidates the cache."""
    h = hashlib.sha256()
    for package in (training.text, training.data):
        for path in sorted(Path(package.__file__).parent.glob("*")):
            if path.suffix in (".py", ".txt"):
                h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def preprocess_key(data: DataConfig, pre: PreprocessConfig, augment: AugmentConfig, tokenizer: str | None = None,
                   unlabelled: str | None = None, spans: int = 0) -> str:
    """The content address of a prepared folder: every input that can change its bytes (a pretrained model's
    tokenizer by the digest of its files: two tokenizers never share a folder)."""
    payload = json.dumps(
        {
            "dataset": dataset_digest(data.dataset),
            "test_dataset": file_digest(data.test_dataset),
            "data": data.model_dump(exclude={"dataset", "test_dataset"}),
            "pre": pre.model_dump(exclude={"user_dict", "stopwords_file", "num_workers"}),
            "files": [file_digest(pre.user_dict), file_digest(pre.stopwords_file)],
            "augment": augment.model_dump() if augment.enabled else None,
            "synonyms": file_digest(augment.synonyms) if augment.enabled else None,
            "code": code_version(),
            "tokenizer": tokenizer_key(tokenizer) if tokenizer else None,
            "unlabelled": file_digest(unlabelled) if unlabelled else None,
            **({"spans": spans} if spans else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def _cache_key(ctx, params: dict) -> str:
    # the folder name is already the content address; the full path keeps two ZHFLOW_HOMEs apart
    return "zhflow-prepare-" + hashlib.sha256(str(params["out_dir"]).encode()).hexdigest()[:32]


class OwnedLockManager(FileSystemLockManager):
    """Prefect's lock files, each marked with the process that holds it (``tasks.recover.owner``): a lock whose
    process is gone (killed while it prepared the folder) is removed instead of waited for, for ever. Marking and
    removing happen under a guard (a thread lock and an flock on the folder's ``.guard``), so that two waiters never
    both break the same dead lock, nor a releaser remove a mark its successor just wrote."""

    _threads = threading.Lock()

    @contextmanager
    def _guard(self) -> Iterator[None]:
        self._ensure_lock_files_directory_exists()
        with self._threads, open(self.lock_files_directory / ".guard", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or its process dies
            yield

    def _mark(self, key: str) -> Path:
        return self._lock_path_for_key(key).with_suffix(".owner")

    def acquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                     hold_timeout: float | None = None) -> bool:
        acquired = super().acquire_lock(key, holder, acquire_timeout, hold_timeout)
        if acquired:
            with self._guard():
                self._mark(key).write_text(owner())
        return acquired

    def release_lock(self, key: str, holder: str) -> None:
        with self._guard():  # the mark first: a lock found unmarked is held, never broken
            info = self._get_lock_info(key, use_cache=False)  # not is_lock_holder: it calls is_locked, which guards
            if info is not None and info["holder"] == holder:
                self._mark(key).unlink(missing_ok=True)
        super().release_lock(key, holder)

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        if not super().is_locked(key, use_cache):
            return False
        with self._guard():
            try:
                mark = self._mark(key).read_text()
            except OSError:  # not marked yet (being taken now), or by an older zhflow: held
                return True
            if not owner_gone(mark):
                return True
            self._lock_path_for_key(key).unlink(missing_ok=True)
            self._mark(key).unlink(missing_ok=True)
            self._locks.pop(key, None)
            return False


def _cache_policy() -> CacheKeyFnPolicy:
    """Cached by content address; SERIALIZABLE with a file lock, so parallel sweep trials that need the same
    prepared folder wait for the first one instead of writing it twice."""
    locks = work_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return CacheKeyFnPolicy(cache_key_fn=_cache_key).configure(
        isolation_level="SERIALIZABLE", lock_manager=OwnedLockManager(lock_files_directory=locks))


def _own_transaction(call):
    """``call()`` outside the enclosing Prefect transaction (a sweep trial's task): its cached result is committed and
    its lock released when it returns. Nested, Prefect defers both to the outermost task's end: a trial held the
    lock while it trained, so that parallel trials on the same data ran one after the other, and a Ctrl-C left the
    lock behind for the next sweep to wait on for ever."""
    def detached():
        BaseTransaction.__var__.set(None)  # no parent: Prefect's get_transaction() reads this variable
        return call()

    return contextvars.copy_context().run(detached)


_DATASETS = threading.Lock()


def _log_input(dataset, context: str) -> None:
    """``mlflow.log_input``, one at a time in this process and tried again once on a collision: MLflow's SQL store
    looks a dataset up, then inserts it, so that two parallel trials logging the same split at once failed one of
    them on the table's unique constraint."""
    with _DATASETS:
        try:
            mlflow.log_input(dataset, context=context)
        except MlflowException as err:  # another process inserted it between MLflow's look-up and its insert
            if "unique constraint" not in str(err).lower():
                raise
            mlflow.log_input(dataset, context=context)


@task(name="prepare-data", persist_result=True)
def prepare_data(data: DataConfig, pre: PreprocessConfig, augment: AugmentConfig, out_dir: str,
                 tokenizer: str | None = None, unlabelled: str | None = None, spans: int = 0) -> dict:
    if (Path(out_dir) / MANIFEST).is_file():  # its name is its content's address: prepared while this task waited for
        # the lock (a parallel trial; rewriting it would pull it from under that trial's worker), or its record was lost
        return {"path": out_dir, "manifest": load_manifest(out_dir), "reused": True}
    manifest = prepare_dataset(data, pre, out_dir, progress=True, augment=augment, tokenizer=tokenizer,
                               unlabelled=unlabelled, spans=spans)
    return {"path": out_dir, "manifest": manifest}


@task(name="preprocess")
def preprocess(data: DataConfig, pre: PreprocessConfig, augment: AugmentConfig, parent: dict,
               tokenizer: str | None = None, stage: str = "preprocess", unlabelled: str | None = None,
               spans: int = 0) -> dict:
    """Prepare (or reuse) the dataset folder and record it in a nested ``stage`` run; ``tokenizer``, ``unlabelled``,
    ``spans``: see ``training.data.prepare.prepare_dataset``."""
    logger = get_run_logger()
    out_dir = work_root() / "prepared" / preprocess_key(data, pre, augment, tokenizer, unlabelled, spans)
    fresh = not (out_dir / MANIFEST).is_file()  # the folder is gone: the cache entry is stale
    with stage_run(parent, stage) as run:
        state = _own_transaction(lambda: prepare_data.with_options(refresh_cache=fresh, cache_policy=_cache_policy())(
            data, pre, augment, str(out_dir), tokenizer, unlabelled, spans, return_state=True))
        prepared = state.result()
        manifest = prepared["manifest"]
        cached = state.name == "Cached" or prepared.pop("reused", False)
        mlflow.set_tags({"cache_hit": str(cached).lower(), "prepared_dir": prepared["path"]})
        mlflow.log_metrics({f"count_{k}": v for k, v in manifest["counts"].items()}
                           | {f"{s}_texts": v["n"] for s, v in manifest["splits"].items()}
                           | {f"{s}_oov_rate": v["unk_rate"] for s, v in manifest["splits"].items()}
                           | {"vocab_size": manifest["vocab_size"]}
                           | ({f"{s}_truncated": n for s, n in manifest["tokenizer"]["truncated"].items()}
                              if manifest.get("tokenizer") else {}))
        mlflow.log_dict(manifest, "manifest.json")
        with warnings.catch_warnings():  # MLflow registers its local-file source twice and warns that it must pick one
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(manifest["dataset"]["source"])
        for split, context in (("train", "training"), ("val", "validation"), ("test", "testing")):
            # labels as written ("2", "10"): text, as everywhere else (read as numbers, MLflow warns of integer columns)
            frame = pd.read_json(Path(prepared["path"]) / f"{split}.jsonl", lines=True, dtype=False)[["clean", "label"]]
            dataset = mlflow.data.from_pandas(frame, source=source, targets="label",
                                              name=f"{Path(manifest['dataset']['name']).name}-{split}",
                                              digest=manifest["splits"][split]["digest"][:16])
            _log_input(dataset, context)
        markdown = manifest_markdown(manifest)
        mlflow.log_text(markdown, "manifest.md")
        create_markdown_artifact(markdown, key="prepared-dataset", description="Counts, splits and vocabulary")
        c = manifest["counts"]
        logger.info(
            "%s: %d read, %d empty, %d duplicates and %d conflicting-label rows dropped -> %s; vocabulary %d%s",
            manifest["dataset"]["name"], c["read"], c["empty_dropped"], c["duplicates_dropped"], c["conflict_rows_dropped"],
            ", ".join(f"{s} {v['n']}" for s, v in manifest["splits"].items()), manifest["vocab_size"],
            " (cached)" if cached else "",
        )
        return {**prepared, "run_id": run.info.run_id, "cached": cached}
