"""What the torchrun worker is told to do: the model and training settings, and the run's facts (paths, run id)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from training.config import EncoderConfig, ModelConfig, TrainConfig, _Section

class WorkerJob(_Section):
    """What the torchrun worker is told to do (written as JSON by the launcher)."""

    stage: str = Field(description="Which stage this run is (names the progress lines and the output folder).")
    prepared_dir: str = Field(description="Prepared dataset folder (manifest.json, *.npy).")
    out_dir: str = Field(description="Where checkpoints and the events file (training.events) go.")
    model: ModelConfig
    train: TrainConfig
    max_len: int = Field(ge=1, description="Texts are truncated to this many tokens.")
    init_checkpoint: Optional[str] = Field(None, description="Start from these weights (fine-tuning a pruned model).")
    keep_sparsity: bool = Field(False, description="Keep zero weights of init_checkpoint at zero (pruning masks).")
    mlflow_run_id: Optional[str] = Field(None, description="MLflow run that rank 0 logs into.")
    epochs_setting: str = Field("train.epochs", description="The setting that gave train.epochs (named when it stops training).")
    teacher_probs: Optional[str] = Field(None, description="Distillation: the teacher's probabilities of every train row (.npy).")
    temperature: float = Field(1.0, gt=0, description="Distillation temperature (distill.temperature).")
    alpha: float = Field(0.0, ge=0, le=1, description="Weight of the distillation term (distill.alpha).")
    deadline: Optional[float] = Field(None, description="Unix time by which training ends (train.timeout_minutes): "
                                                        "no epoch starts that would end after it.")


class PretrainJob(_Section):
    """What the pretraining worker (``training.mlm``) is told to do (written as JSON by the launcher)."""

    stage: str = Field("pretrain", description="Names the progress lines.")
    corpus_dir: str = Field(description="Prepared corpus folder (training.corpus: manifest.json, train/, heldout/, tokenizer/).")
    out_dir: str = Field(description="Where checkpoints (ckpt/) and the events file go.")
    export_dir: str = Field(description="Where the save_pretrained folder of the trained encoder goes.")
    model: EncoderConfig
    train: TrainConfig
    checkpoint_minutes: float = Field(10.0, gt=0, description="Inside an epoch: a checkpoint once this much training has passed.")
    mlflow_run_id: Optional[str] = Field(None, description="MLflow run that rank 0 logs into.")
    deadline: Optional[float] = Field(None, description="Unix time by which training ends (train.timeout_minutes).")
