"""The ``pretrain`` flow: corpus (read, clean, deduplicate, exclude prepared val/test texts, tokenize and segment, in
shards) -> masked-language-model pretraining under DDP or FSDP2 -> a save_pretrained folder that the ``pretrained``
family fine-tunes.

    zhflow pretrain --corpus reviews.txt --size small --nproc 2 --out models/zh-small
    zhflow run --model pretrained --pretrained models/zh-small
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from training.config import ExperimentName, PretrainConfig
from training.corpus import check_corpus
from training.paths import check_path
from tasks.pretrain import corpus_stage, pretrain_stage
from tasks.tracking import close_pipeline_run, fail_open_runs, open_pipeline_run
from tasks.train import with_limits


def _run_name() -> str:
    return f"pretrain-{flow_run.scheduled_start_time.strftime('%Y%m%d-%H%M%S')}"


def check_pretrain(config: PretrainConfig) -> None:
    """The corpus and the checkpoint, before any run is opened: one clear error naming the file or the field."""
    for field, names in (("corpus.files", config.corpus.files), ("corpus.exclude_prepared", config.corpus.exclude_prepared),
                         ("out", [config.out]), ("model.size", [config.model.size if config.model.size.endswith(".json") else None])):
        for name in names:
            check_path(field, name)  # a path from the form may not leave the allowed folders
    check_corpus(config.corpus)
    if config.model.init_from:
        from training.models.pretrained import check_source

        try:
            check_source(config.model.init_from)
        except ValueError as err:
            raise type(err)(str(err).replace("model.pretrained", "model.init_from")) from None
    elif config.model.size.endswith(".json") and not Path(config.model.size).expanduser().is_file():
        from training.config import ConfigError

        raise ConfigError(f"model.size: {config.model.size}: no such config file")


@flow(name="pretrain", flow_run_name=_run_name, log_prints=True,
      on_failure=[fail_open_runs], on_crashed=[fail_open_runs], on_cancellation=[fail_open_runs])
def pretrain(config: PretrainConfig, experiment: ExperimentName = "zhflow-pretrain") -> dict:
    """Pretrain a Chinese encoder with masked-language modelling (whole-word masking from jieba) on unlabelled text,
    from scratch or continued from a checkpoint, under DDP or sharded FSDP2; tracked in MLflow.

    Args:
        config: The corpus, the encoder (a size, or a checkpoint to continue) and the training settings.
        experiment: MLflow experiment of the run (created if missing).
    """
    check_pretrain(config)
    parent = open_pipeline_run(config, experiment, kind="pretrain")
    corpus = corpus_stage(config, parent)
    result = with_limits(pretrain_stage, config.train)(config, corpus, parent)
    c = corpus["manifest"]["counts"]
    metrics = {"heldout_loss": result["heldout_loss"], "heldout_perplexity": result["heldout_perplexity"],
               "tokens_per_second": result["tokens_per_second"], "train_tokens": corpus["manifest"]["train_tokens"],
               "corpus_texts": c["kept"], "excluded_texts": c["excluded"], "restarts": result["restarts"]}
    metrics = {k: v for k, v in metrics.items() if v is not None and v == v}
    close_pipeline_run(parent, metrics, {"encoder": result["export_dir"], "strategy": result["strategy"]})
    return {"run_id": parent["run_id"], "experiment_id": parent["experiment_id"], "corpus_run_id": corpus["run_id"],
            "pretrain_run_id": result["run_id"], "corpus_dir": corpus["path"], "corpus": corpus["manifest"]["counts"],
            "train_tokens": corpus["manifest"]["train_tokens"], "vocab_size": corpus["manifest"]["tokenizer"]["vocab_size"],
            "output": result["export_dir"], "resumed_at_step": result["resumed_at_step"],
            "restarts": result["restarts"], "restart_causes": result["restart_causes"], "epochs_run": result["epochs_run"], "steps": result["steps"],
            "strategy": result["strategy"], "world_size": result["world_size"], "stop_reason": result["stop_reason"],
            "heldout_loss": result["heldout_loss"], "perplexity": result["heldout_perplexity"],
            "tokens_per_second": result["tokens_per_second"], "peak_memory_mb": result["peak_memory_mb"],
            "parameters": result["parameters"]}
