"""Pretraining tasks: the corpus (content-addressed and cached, resumed shard by shard) and the MLM worker under
torchrun; each a nested MLflow run of the ``pretrain`` parent."""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path

import mlflow
from mlflow.data.meta_dataset import MetaDataset
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

import training.corpus
from training.config import CorpusConfig, EncoderConfig, PretrainConfig, flatten
from training.corpus import corpus_digest, corpus_sources, prepare_corpus
from training.job import PretrainJob
from tasks.launch import launch_training, resolve_nproc, restart_tags
from tasks.preprocess import _cache_policy, code_version
from tasks.tracking import stage_run, work_root


def corpus_key(corpus: CorpusConfig, model: EncoderConfig) -> str:
    """The content address of a prepared corpus: the files' bytes, the settings that change the arrays, the
    tokenizer's origin, the excluded datasets' texts and the code."""
    excluded = [corpus_digest([Path(p).expanduser() / "val.jsonl", Path(p).expanduser() / "test.jsonl"])
                for p in corpus.exclude_prepared]
    source = Path(training.corpus.__file__).read_bytes()
    payload = json.dumps({
        "files": corpus_digest(corpus_sources(corpus)), "corpus": corpus.model_dump(exclude={"files", "num_workers", "exclude_prepared"}),
        "model": model.model_dump(include={"init_from", "size", "vocab_size", "max_len", "masking"}),
        "size_file": hashlib.sha256(Path(model.size).read_bytes()).hexdigest() if model.size.endswith(".json") else None,
        "excluded": excluded, "code": code_version() + hashlib.sha256(source).hexdigest()[:16],
    }, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


@task(name="prepare-corpus", persist_result=True)
def prepare_corpus_task(corpus: CorpusConfig, model: EncoderConfig, out_dir: str) -> dict:
    logger = get_run_logger()
    manifest = prepare_corpus(corpus, model, out_dir, progress=logger.info)
    return {"path": out_dir, "manifest": manifest}


def corpus_markdown(manifest: dict) -> str:
    c = manifest["counts"]
    rows = [("texts read", c["read"]), ("empty after cleaning", c["empty"]), ("duplicates dropped", c["duplicates"]),
            ("in a prepared val/test split, removed", c["excluded"]), ("held out (MLM loss, perplexity)", c["held_out"]),
            ("texts for training", c["kept"]), ("texts cut into several sequences", manifest["split_texts"]),
            ("training sequences", manifest["train_sequences"]), ("training tokens", manifest["train_tokens"]),
            ("shards", manifest["shards"]), ("vocabulary", manifest["tokenizer"]["vocab_size"])]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (f"## Pretraining corpus\n\n{', '.join(manifest['files'])}\n\ntokenizer: {manifest['tokenizer']['source']}; "
            f"masking: {manifest['masking']}; max length {manifest['max_len']}\n\n| | count |\n|---|---|\n{table}\n")


@task(name="corpus")
def corpus_stage(config: PretrainConfig, parent: dict) -> dict:
    """Prepare (or reuse) the corpus folder and record it in the nested ``corpus`` run: counts, manifest, the corpus
    as a dataset input (its digest)."""
    logger = get_run_logger()
    out_dir = work_root() / "corpora" / corpus_key(config.corpus, config.model)
    fresh = not (out_dir / training.corpus.MANIFEST).is_file()
    with stage_run(parent, "corpus") as run:
        state = prepare_corpus_task.with_options(refresh_cache=fresh, cache_policy=_cache_policy())(
            config.corpus, config.model, str(out_dir), return_state=True)
        prepared = state.result()
        manifest, cached = prepared["manifest"], state.name == "Cached"
        mlflow.set_tags({"cache_hit": str(cached).lower(), "corpus_dir": prepared["path"]})
        mlflow.log_metrics({f"count_{k}": v for k, v in manifest["counts"].items()}
                           | {k: manifest[k] for k in ("train_sequences", "train_tokens", "held_out_sequences", "shards", "split_texts")}
                           | {"vocab_size": manifest["tokenizer"]["vocab_size"]})
        mlflow.log_dict(manifest, "manifest.json")
        markdown = corpus_markdown(manifest)
        mlflow.log_text(markdown, "manifest.md")
        with warnings.catch_warnings():  # MLflow registers its local-file source twice and warns that it must pick one
            warnings.simplefilter("ignore", UserWarning)
            from mlflow.data.dataset_source_registry import resolve_dataset_source

            source = resolve_dataset_source(manifest["files"][0])
        mlflow.log_input(MetaDataset(source, name=Path(manifest["files"][0]).name, digest=manifest["digest"][:16]),
                         context="pretraining")
        create_markdown_artifact(markdown, key="pretraining-corpus", description="Counts, shards and tokenizer of the corpus")
        c = manifest["counts"]
        logger.info("corpus: %d read, %d empty, %d duplicates, %d in prepared val/test splits removed, %d held out -> "
                    "%d texts, %d sequences, %d tokens in %d shard(s)%s", c["read"], c["empty"], c["duplicates"],
                    c["excluded"], c["held_out"], c["kept"], manifest["train_sequences"], manifest["train_tokens"],
                    manifest["shards"], " (cached)" if cached else "")
        return {**prepared, "run_id": run.info.run_id, "cached": cached}


@task(name="pretrain-encoder")
def pretrain_stage(config: PretrainConfig, corpus: dict, parent: dict) -> dict:
    """The MLM worker under torchrun (DDP or FSDP2) in the nested ``pretrain`` run; the trained encoder's
    save_pretrained folder logged as its artifact ``encoder``."""
    train = config.train
    nproc = resolve_nproc(train.nproc)
    out_dir = Path(parent["work_dir"]) / "pretrain"
    export = Path(config.out).expanduser().resolve() if config.out else out_dir / "encoder"
    deadline = time.time() + train.timeout_minutes * 60 if train.timeout_minutes else None
    with stage_run(parent, "pretrain") as run:
        job = PretrainJob(corpus_dir=corpus["path"], out_dir=str(out_dir), export_dir=str(export), model=config.model,
                          train=train, checkpoint_minutes=config.checkpoint_minutes, mlflow_run_id=run.info.run_id,
                          deadline=deadline)
        mlflow.log_params(flatten(config.model, "model.") | flatten(train, "train.") | {"nproc_resolved": nproc})
        result = launch_training(job, module="training.mlm")
        mlflow.set_tags({**restart_tags(result), "stop_reason": result["stop_reason"],
                         "strategy": result["strategy"], "export_dir": result["export_dir"],
                         "torchrun": f"nnodes={train.nnodes} nproc_per_node={nproc}"})
        mlflow.log_metrics({"parameters": result["parameters"]})
        mlflow.log_artifacts(result["export_dir"], "encoder")
        return {**result, "run_id": run.info.run_id}
