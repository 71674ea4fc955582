"""The pretraining worker: masked-language modelling of a BERT-like encoder, started by torchrun.

    torchrun --standalone --nproc-per-node 2 -m training.mlm --config job.json    # DDP or FSDP2, by train.strategy

``job.json`` is a ``training.job.PretrainJob``; the corpus is a folder of ``training.corpus``. Each rank reads its own
rows of the memory-mapped shards (DistributedSampler). Masks are drawn anew each epoch (dynamic masking), 15% of the
tokens by default, 80% [MASK] / 10% a random token / 10% kept; with whole-word masking the tokens of one jieba word are
chosen together. A batch's masks come from a generator seeded by (seed, rank, epoch, batch), so a resumed run draws
the same ones. The prediction head runs on the masked positions only (``predict_masked_only``).

``train.strategy=fsdp`` shards the model with FSDP2 (``fully_shard`` per encoder layer, then at the root; bf16
parameters and fp32 gradient reduction under ``train.precision=bf16``; fp16 with a gradient scaler), also in a single
process (a process group of one for its mesh); ``ddp`` replicates it. Checkpoints go through
``torch.distributed.checkpoint`` (each rank writes its own shards), written under a temporary name and renamed whole,
at each epoch's end and every ``checkpoint_minutes`` inside one; a restarted group resumes from the last one at the
batch it had reached, and the metrics are sent to MLflow only with the checkpoint that holds their steps, so no step
is logged twice. Rank 0 writes the trained encoder as a ``save_pretrained`` folder (safetensors, config, tokenizer).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from training import distributed
from training.corpus import HELD_OUT, MANIFEST, SIZES, SPECIAL, TOKENIZER_DIR, WORD_START, CorpusShards
from training.evaluate import autocast, autocast_dtype
from training.events import EVENTS_FILE, EventWriter
from training.job import PretrainJob
from training.metric_logger import MetricLogger, NullLogger
from training.worker import LRSchedule, RankZeroOutput, _fault_injection, parameter_groups

CHECKPOINTS = "ckpt"
LATEST = "latest.json"
MMAP_THRESHOLD = 128 * 1024  # bytes: larger blocks are mapped, and unmapped when freed (release_freed_memory)


def mask_tokens(ids: np.ndarray, words: np.ndarray, rng: np.random.Generator, mask_prob: float, mask_id: int,
                vocab_size: int, whole_word: bool) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of one sequence: about ``mask_prob`` of its tokens chosen (whole jieba words together, or
    single tokens), their labels the original ids (-100 elsewhere); 80% of them become [MASK], 10% a random token."""
    inputs, labels = ids.copy(), np.full_like(ids, -100)
    candidates = np.flatnonzero(words != SPECIAL)
    if not len(candidates):
        return inputs, labels
    if whole_word:  # a unit per word: the tokens from one WORD_START to the next
        unit = np.cumsum(words[candidates] == WORD_START) - 1
        unit -= unit.min()
    else:
        unit = np.arange(len(candidates))
    sizes = np.bincount(unit)
    target = max(1, int(round(len(candidates) * mask_prob)))
    order = rng.permutation(len(sizes))
    taken = np.cumsum(sizes[order]) <= target
    taken[0] = True  # at least one unit, even a word longer than the target
    chosen = candidates[np.isin(unit, order[taken])]
    labels[chosen] = ids[chosen]
    roll = rng.random(len(chosen))
    inputs[chosen[roll < 0.8]] = mask_id
    swap = chosen[(roll >= 0.8) & (roll < 0.9)]
    inputs[swap] = rng.integers(0, vocab_size, len(swap))
    return inputs, labels


def collate(rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded inputs, attention mask and labels (-100 on padding)."""
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (inputs, target) in enumerate(rows):
        ids[i, : len(inputs)] = torch.from_numpy(inputs)
        labels[i, : len(target)] = torch.from_numpy(target)
        mask[i, : len(inputs)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def encoder_config(job: PretrainJob, tokenizer):
    """A new encoder's transformers config: the size's shape, the corpus tokenizer's vocabulary and pad id."""
    from transformers import AutoConfig, BertConfig

    size = job.model.size
    if size in SIZES:
        shape = {k: v for k, v in SIZES[size].items() if k != "vocab_size"}
        config = BertConfig(**shape)
    else:
        data = json.loads(Path(size).read_text())
        config = AutoConfig.for_model(data.pop("model_type", "bert"), **data)
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    offset = (config.pad_token_id + 1) if config.model_type in ("roberta", "xlm-roberta", "camembert") else 0
    given = getattr(config, "max_position_embeddings", 0) if size not in SIZES else 0
    config.max_position_embeddings = max(given, job.model.max_len + offset)
    return config


def predict_masked_only(model: torch.nn.Module) -> bool:
    """Make ``model(input_ids, attention_mask, labels)`` return the MLM loss with the prediction head applied to the
    masked positions only, not to every position: the loss is the same (the mean cross-entropy over the masked
    tokens), and the head's vocabulary-wide matrix product shrinks to about ``mask_prob`` of the tokens (a 4-layer,
    128-wide encoder on 2 processes of 1 thread: 1.53-1.55x the tokens/s under DDP, 1.29-1.32x under FSDP2;
    BENCHMARKS.md, pretraining throughput). The instance's forward is replaced, so
    DDP's and FSDP2's hooks, which run around it, are kept, and the state dict does not change. False, and the model
    left as it is, where the head is not one module beside the encoder (BERT's ``cls``, RoBERTa's ``lm_head``)."""
    base_name = model.base_model_prefix
    heads = [module for name, module in model.named_children() if name != base_name]
    if not hasattr(model, base_name) or len(heads) != 1:
        return False
    base, head = getattr(model, base_name), heads[0]

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = base(input_ids=input_ids, attention_mask=attention_mask)[0]
        chosen = labels != -100
        scores = head(hidden[chosen])
        # summed, then divided by at least 1: a batch with no masked token (a held-out filler batch) gives 0, not NaN
        return F.cross_entropy(scores.float(), labels[chosen], reduction="sum") / chosen.sum().clamp(min=1)

    model.forward = forward
    return True


def encoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP2 shards one by one (BERT, RoBERTa and their kin: ``<base>.encoder.layer``)."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None:
        raise ValueError(f"train.strategy=fsdp: {type(model).__name__} has no encoder.layer list to shard")
    return list(layers)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (each one is created, then its storage dropped at
    once, so no more than one parameter is ever allocated); buffers such as position ids stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def materialise_shards(model: torch.nn.Module, info: distributed.DistInfo, seed: int, from_checkpoint: bool = False,
                       checkpoint: dict | None = None) -> None:
    """Storage for a model built on the meta device and sharded by ``fully_shard``: each rank allocates only its own
    shards. ``from_checkpoint``: they are filled from ``checkpoint``, the full state dict that rank 0 alone has read,
    rank 0 broadcasting. Else each rank initialises its shards as ``init_weights`` would the whole model (normal(0,
    initializer_range), norms at one, biases at zero), drawn from a generator seeded by (seed, rank): distinct rows of
    one initialisation, reproducible for a given number of ranks. No rank but rank 0 reading a checkpoint ever holds
    the full model."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=info.device)
    with torch.no_grad():
        for name, value in buffers.items():
            owner, _, leaf = name.rpartition(".")
            getattr(model.get_submodule(owner), leaf).copy_(value.to(info.device))
        if from_checkpoint:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, (checkpoint or {}) if info.is_main else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            return
        state = torch.random.get_rng_state()
        torch.manual_seed(int(np.random.SeedSequence([seed, info.rank, 11]).generate_state(1)[0]))
        for module in model.modules():  # marked when the model was built; its storage is new now
            module.__dict__.pop("_is_hf_initialized", None)
        model.init_weights()
        torch.random.set_rng_state(state)


def release_freed_memory() -> None:
    """Large blocks freed by this process go back to the system at once (glibc: a fixed mmap threshold of 128 KiB
    instead of the dynamic one that grows to 32 MiB and keeps freed gathers and activations in the heap). Under FSDP
    on CPU that is the memory the sharding saves; it costs some speed (about a fifth on a small encoder), which is why
    only ``train.strategy=fsdp`` asks for it. A ``MALLOC_MMAP_THRESHOLD_`` the user set is left as it is."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(ctypes.c_int(-3), ctypes.c_int(MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def resident_mb() -> float:
    """This process's resident memory now (Linux; 0 where /proc is missing)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class PretrainTrainer(RankZeroOutput):
    def __init__(self, job: PretrainJob, info: distributed.DistInfo):
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        self.job, self.info, self.t = job, info, job.train
        self.base_memory_mb = resident_mb()  # the process before the model: interpreter, torch, transformers
        self.out, self.corpus = Path(job.out_dir), Path(job.corpus_dir)
        self.manifest = json.loads((self.corpus / MANIFEST).read_text())
        self.tokenizer = AutoTokenizer.from_pretrained(self.corpus / TOKENIZER_DIR)
        self.pad_id, self.mask_id, self.vocab = self.tokenizer.pad_token_id, self.tokenizer.mask_token_id, len(self.tokenizer)
        self.fsdp = self.t.strategy == "fsdp"
        self.amp_dtype = autocast_dtype(self.t.precision, info.device)
        if self.fsdp and info.device.type == "cpu":
            release_freed_memory()
        torch.manual_seed(self.t.seed)  # the same initial weights on every rank
        # under FSDP the encoder is built without storage and each rank fills only its own shards: a new one from
        # its initialisation, a checkpoint from rank 0, the one rank that reads it whole
        on_meta, checkpoint = self.fsdp, None
        if job.model.init_from and not on_meta:
            from training.models.pretrained import _load

            model = _load("AutoModelForMaskedLM", job.model.init_from)
        elif on_meta:
            if job.model.init_from:
                from training.models.pretrained import _load, load_config

                config = load_config(job.model.init_from)
                if info.is_main:
                    checkpoint = _load("AutoModelForMaskedLM", job.model.init_from).state_dict()
            else:
                config = encoder_config(job, self.tokenizer)
            with parameters_on_meta():
                model = AutoModelForMaskedLM.from_config(config)
        else:
            model = AutoModelForMaskedLM.from_config(encoder_config(job, self.tokenizer))
        self.config = model.config
        predict_masked_only(model)
        if self.t.gradient_checkpointing:
            from training.models.pretrained import activation_checkpointing

            activation_checkpointing(model)
        if not on_meta:
            model.to(info.device)
        if self.fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=self.amp_dtype, reduce_dtype=torch.float32) if self.amp_dtype else MixedPrecisionPolicy()
            for layer in encoder_layers(model):
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            materialise_shards(model, info, self.t.seed, bool(job.model.init_from), checkpoint)
            self.model = model
        else:
            self.model = DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None) if info.ddp else model
        self.raw = model
        self.train_set, self.held_out = CorpusShards(self.corpus, "train"), CorpusShards(self.corpus, HELD_OUT)
        self.sampler = DistributedSampler(self.train_set, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=self.t.seed)
        self.batches = math.ceil(len(self.sampler) / self.t.batch_size)
        self.optimizer = torch.optim.AdamW(parameter_groups(model, self.t.weight_decay), lr=self.t.lr)
        # fp16: losses scaled, overflow steps skipped (under FSDP2 the sharded gradients are DTensors, whose overflow
        # check is reduced over the mesh, so every rank skips the same steps)
        self.scaler = torch.amp.GradScaler(info.device.type, enabled=self.amp_dtype == torch.float16)
        self.steps_per_epoch = math.ceil(self.batches / self.t.grad_accum)
        self.total_steps = self.t.epochs * self.steps_per_epoch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, LRSchedule(self.total_steps, int(self.total_steps * self.t.warmup_ratio), self.t.schedule))
        self.log = MetricLogger(job.mlflow_run_id) if info.is_main and job.mlflow_run_id else NullLogger()
        self.events = EventWriter(self.out / EVENTS_FILE) if info.is_main else None
        self.epoch, self.batch, self.step, self.restarts = 0, 0, 0, distributed.group_restarts(info)
        self.history: list[dict] = []
        self._resume()
        self.resumed_at_step = self.step
        self._saved_at = time.perf_counter()

    # ---- checkpoints (torch.distributed.checkpoint: each rank writes its shards) ----------------------------------
    def _barrier(self) -> None:
        if self.info.ddp:
            dist.barrier()

    def _resume(self) -> None:
        latest = self.out / CHECKPOINTS / LATEST
        if not latest.is_file():
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        meta = json.loads(latest.read_text())
        folder = self.out / CHECKPOINTS / meta["folder"]
        model_state, optim_state = get_state_dict(self.raw, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(self.raw, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        trainer = torch.load(folder / "trainer.pt", weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        if trainer.get("scaler"):
            self.scaler.load_state_dict(trainer["scaler"])
        self.epoch, self.batch, self.step, self.history = meta["epoch"], meta["batch"], meta["step"], meta["history"]
        self.print(f"resumed from {folder} at epoch {self.epoch + 1}, batch {self.batch} (step {self.step}; restart {self.restarts})")

    def _save(self) -> None:
        """A checkpoint of every rank's shards at (epoch, batch), renamed into place whole; then the metrics it covers
        are sent."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        root = self.out / CHECKPOINTS
        name = f"step-{self.step:08d}"
        tmp = root / (name + ".tmp")
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        model_state, optim_state = get_state_dict(self.raw, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        self._barrier()
        if self.info.is_main:
            torch.save({"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}, tmp / "trainer.pt")
            shutil.rmtree(root / name, ignore_errors=True)
            os.replace(tmp, root / name)
            meta = {"folder": name, "epoch": self.epoch, "batch": self.batch, "step": self.step, "history": self.history}
            (root / (LATEST + ".tmp")).write_text(json.dumps(meta))
            os.replace(root / (LATEST + ".tmp"), root / LATEST)
            for old in root.glob("step-*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        self.log.flush()
        self._saved_at = time.perf_counter()

    # ---- the loop -------------------------------------------------------------------------------------------------
    def _batch(self, indices: list[int], epoch: int, number: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.t.seed, self.info.rank, epoch, number])
        rows = [mask_tokens(*self.train_set[i], rng, self.job.model.mask_prob, self.mask_id, self.vocab,
                            self.job.model.masking == "wwm") for i in indices]
        return collate(rows, self.pad_id)

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(self.info.device, non_blocking=True) for k, v in batch.items()}
        ctx = contextlib.nullcontext() if self.fsdp else autocast(self.t.precision, self.info.device)
        with ctx:
            loss = self.model(**batch)
            return (loss if isinstance(loss, torch.Tensor) else loss.loss).float()

    def _past_deadline(self) -> bool:
        return self.job.deadline is not None and distributed.broadcast_flag(time.time() > self.job.deadline, self.info)

    def _checkpoint_due(self) -> bool:
        return distributed.broadcast_flag(time.perf_counter() - self._saved_at >= 60 * self.job.checkpoint_minutes, self.info)

    def _run_epoch(self) -> tuple[float, float, bool]:
        """From batch ``self.batch`` of epoch ``self.epoch`` to its end; (mean loss, tokens/s, cut by the deadline)."""
        self.sampler.set_epoch(self.epoch)
        torch.manual_seed(int(np.random.SeedSequence([self.t.seed, self.info.rank, self.epoch, self.batch]).generate_state(1)[0]))
        order = list(self.sampler)
        self.model.train()
        started, tokens, loss_sum, n_loss, report_every = time.perf_counter(), 0, None, 0, max(1, self.batches // 10)
        window, in_window = None, 0
        for number in range(self.batch, self.batches):
            if self._past_deadline():
                return self._mean(loss_sum, n_loss), tokens * self.info.world_size / (time.perf_counter() - started), True
            batch = self._batch(order[number * self.t.batch_size:(number + 1) * self.t.batch_size], self.epoch, number)
            tokens += int(batch["attention_mask"].sum())
            last_micro = (number + 1) % self.t.grad_accum == 0 or number + 1 == self.batches
            sync = self.model.no_sync() if self.info.ddp and not self.fsdp and not last_micro else contextlib.nullcontext()
            if self.fsdp:
                self.model.set_requires_gradient_sync(last_micro)
            with sync:
                loss = self._forward(batch)
                self.scaler.scale(loss / self.t.grad_accum).backward()
            window = loss.detach() if window is None else window + loss.detach()
            in_window += 1
            self.batch = number + 1
            if last_micro:
                if self.t.grad_clip > 0:
                    self.scaler.unscale_(self.optimizer)  # clipping sees the true gradients (a no-op without fp16)
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.t.grad_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                _fault_injection(self.info, self.step)
            if self.batch % report_every == 0 or self.batch == self.batches:
                mean = window.item() / in_window  # the one host sync of a window of batches
                loss_sum, n_loss = (loss_sum or 0.0) + mean * in_window, n_loss + in_window
                window, in_window = None, 0
                rate = tokens * self.info.world_size / (time.perf_counter() - started)
                self.log.add(self.step, mlm_loss=mean, lr=self.scheduler.get_last_lr()[0], tokens_per_second=rate)
                self.emit("progress", epoch=self.epoch + 1, epochs=self.t.epochs, fraction=self.batch / self.batches)
                self.print(f"epoch {self.epoch + 1}/{self.t.epochs} [{100 * self.batch // self.batches:3d}%] step {self.step} "
                           f"loss {mean:.4f} {rate:.0f} tokens/s")
            if self.batch < self.batches and last_micro and self._checkpoint_due():
                self._save()
        return self._mean(loss_sum, n_loss), tokens * self.info.world_size / (time.perf_counter() - started), False

    @staticmethod
    def _mean(total: float | None, n: int) -> float:
        return total / n if n else math.nan

    @torch.no_grad()
    def _held_out_loss(self) -> float:
        """Mean MLM loss over the held-out sequences, with masks fixed by each sequence's index (the same every epoch
        and for any number of ranks). Every rank runs as many batches (FSDP's collectives need all of them)."""
        self.model.eval()
        n = len(self.held_out)
        per_rank = math.ceil(n / self.info.world_size)
        mine = [self.info.rank + k * self.info.world_size for k in range(per_rank)]
        total = torch.zeros(2, dtype=torch.float64)
        for begin in range(0, per_rank, self.t.batch_size):
            rows = []
            for i in mine[begin:begin + self.t.batch_size]:
                ids, words = self.held_out[min(i, n - 1)]
                inputs, labels = mask_tokens(ids, words, np.random.default_rng([self.t.seed, 7, i]), self.job.model.mask_prob,
                                             self.mask_id, self.vocab, self.job.model.masking == "wwm")
                rows.append((inputs, labels if i < n else np.full_like(labels, -100)))  # a filler row counts for nothing
            batch = collate(rows, self.pad_id)
            masked = int((batch["labels"] != -100).sum())
            loss = self._forward(batch)  # every rank, also for a batch of filler rows (its loss is not counted)
            if masked:
                total += torch.tensor([float(loss) * masked, masked], dtype=torch.float64)
        if self.info.ddp:
            total = total.to(self.info.device)  # nccl reduces device tensors only
            dist.all_reduce(total)
        self.model.train()
        return float(total[0] / total[1]) if total[1] else math.nan

    def train(self) -> dict:
        self.log.set_tag("restarts", str(self.restarts))
        stopped = "max_epochs"
        while self.epoch < self.t.epochs:
            started = time.perf_counter()
            loss, rate, cut = self._run_epoch()
            held = self._held_out_loss() if len(self.held_out) else math.nan
            if not cut:
                self.epoch, self.batch = self.epoch + 1, 0
            memory = distributed.all_gather_objects(peak_memory_mb(self.info.device), self.info)  # before this epoch's checkpoint
            record_ = {"epoch": self.epoch, "step": self.step, "train_loss": loss, "heldout_loss": held,
                       "heldout_perplexity": math.exp(min(held, 50)) if held == held else math.nan,
                       "tokens_per_second": rate, "epoch_seconds": time.perf_counter() - started, "peak_memory_mb": memory}
            self.history.append(record_)
            self.log.add(self.step, **{k: v for k, v in record_.items() if k not in ("step", "peak_memory_mb") and v == v},
                         **{f"peak_memory_mb_rank{r}": m for r, m in enumerate(memory)})
            self._save()
            self.emit("epoch", **record_)
            self.print(f"epoch {self.epoch}/{self.t.epochs} done in {record_['epoch_seconds']:.1f}s: train loss {loss:.4f}, "
                       f"held-out loss {held:.4f} (perplexity {record_['heldout_perplexity']:.1f}), {rate:.0f} tokens/s")
            if cut:
                stopped = "timeout"
                break
        export = self._export()
        memory = distributed.all_gather_objects(peak_memory_mb(self.info.device), self.info)
        last = self.history[-1] if self.history else {}
        result = {"export_dir": export, "epochs_run": self.epoch, "steps": self.step, "stop_reason": stopped,
                  "world_size": self.info.world_size, "strategy": self.t.strategy, "restarts": self.restarts,
                  "resumed_at_step": self.resumed_at_step, "heldout_loss": last.get("heldout_loss"),
                  "heldout_perplexity": last.get("heldout_perplexity"), "tokens_per_second": last.get("tokens_per_second"),
                  "peak_memory_mb": memory, "base_memory_mb": distributed.all_gather_objects(self.base_memory_mb, self.info),
                  "parameters": sum(p.numel() for p in self.raw.parameters())}  # a sharded parameter counts whole
        self.log.set_tag("stop_reason", stopped)
        self.log.flush()
        self.emit("result", **result)
        return result

    def _export(self) -> str:
        """The trained encoder as a save_pretrained folder (rank 0; under FSDP the full weights are gathered first)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoModelForMaskedLM

        full = get_model_state_dict(self.raw, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        target = Path(self.job.export_dir)
        if self.info.is_main:
            model = AutoModelForMaskedLM.from_config(self.config)
            model.load_state_dict(full)
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        self._barrier()
        return str(target)


@record
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="PretrainJob JSON file")
    args = parser.parse_args(argv)
    job = PretrainJob.model_validate_json(Path(args.config).read_text())
    info = distributed.setup(group=job.train.strategy == "fsdp")
    finished = False
    try:
        Path(job.out_dir).mkdir(parents=True, exist_ok=True)
        trainer = PretrainTrainer(job, info)
        trainer.print(f"{info.world_size} process(es) on {info.device.type} ({job.train.strategy}), {torch.get_num_threads()} "
                      f"thread(s) each; {len(trainer.train_set)} sequences ({trainer.manifest['train_tokens']} tokens), "
                      f"{len(trainer.held_out)} held out; {trainer.total_steps} steps")
        result = trainer.train()
        finished = True
        return result
    finally:
        distributed.cleanup(finished)


if __name__ == "__main__":
    main()
