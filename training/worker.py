"""The training worker: plain PyTorch DDP, started by torchrun.

    torchrun --standalone --nproc-per-node 2 -m training.worker --config job.json   # DDP, 2 processes
    python -m training.worker --config job.json                                   # one process

``job.json`` is a ``training.config.WorkerJob``. Rank 0 logs to MLflow (run id
``mlflow_run_id`` of the job), writes checkpoints, and reports progress, each
epoch and the result as events (``training.events``, ``events.jsonl``). After a
restart (torchrun --max-restarts) it resumes from ``last.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, f1_score
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import prune as torch_prune
from torch.utils.data import DataLoader

from training import distributed
from training.checkpoint import load_checkpoint, save_checkpoint
from training.data.dataset import to_device, train_sampler
from training.data.prepare import load_manifest
from training.distill import WithTeacher, kd_loss
from training.evaluate import autocast, autocast_dtype, open_split, predict_proba
from training.events import EVENTS_FILE, EventWriter
from training.job import WorkerJob
from training.models import family_of
from training.prune import prunable_weights
from training.metric_logger import MetricLogger, NullLogger




class LRSchedule:
    """The learning-rate multiplier of each optimiser step: linear warm-up, then

    - ``plateau``: constant, times ``factor`` for every epoch that did not improve (``decay()``), so the schedule
      never depends on a maximum of epochs that early stopping makes sure is rarely reached;
    - ``linear`` / ``cosine``: decay to zero at step ``total``; ``constant``: 1.

    A callable object rather than a function: LambdaLR keeps its attributes in the scheduler's state_dict, so a
    resumed run carries on with the decays it had.
    """

    def __init__(self, total: int, warmup: int, schedule: str = "linear", factor: float = 0.5):
        self.total, self.warmup, self.schedule, self.factor, self.scale = total, max(1, warmup), schedule, factor, 1.0

    def decay(self) -> None:
        if self.schedule == "plateau":
            self.scale *= self.factor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup * self.scale
        if self.schedule in ("constant", "plateau"):
            return self.scale
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - progress


def improves(val: dict, best: dict | None) -> bool:
    """A better epoch: a higher validation macro-F1, or the same (short of perfect) with a lower validation loss.

    A model still learning on a small or many-class set often keeps its macro-F1 (at first 0, one class predicted)
    for several epochs while its loss falls; counting those epochs as failures stopped such runs before they learnt.
    At a perfect macro-F1 there is nothing left to gain, so a falling loss alone does not keep training going.
    """
    if best is None:
        return True
    if val["val_macro_f1"] != best["val_macro_f1"]:
        return val["val_macro_f1"] > best["val_macro_f1"]
    return val["val_macro_f1"] < 1.0 and val["val_loss"] < best["val_loss"]


def _fault_injection(info, step: int) -> None:
    """Test hooks: with ZHFLOW_TEST_KILL_AT_STEP=N and ZHFLOW_TEST_KILL_ONCE_FILE=F set, rank 1 SIGKILLs
    itself at optimiser step N, once (F marks that it happened)."""
    if os.environ.get("ZHFLOW_TEST_HANG_AT_STEP") == str(step):  # test hook: a worker that hangs (the hard timeout)
        time.sleep(3600)
    at, marker = os.environ.get("ZHFLOW_TEST_KILL_AT_STEP"), os.environ.get("ZHFLOW_TEST_KILL_ONCE_FILE")
    if at and marker and info.rank == min(1, info.world_size - 1) and step == int(at) and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), 9)


def masked_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy with pruning masks folded into plain weights (what gets saved)."""
    clean = copy.deepcopy(model)
    for module, name in prunable_weights(clean, include_embedding=True):
        if torch_prune.is_pruned(module) and hasattr(module, f"{name}_mask"):
            torch_prune.remove(module, name)
    return clean


def sparse_tables(model: torch.nn.Module) -> list[torch.nn.Embedding]:
    """Embedding tables with sparse gradients (``sparse=True``: a fastText model's token and n-gram tables)."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse]


def row_exchange_tables(model: torch.nn.Module) -> list[torch.nn.Embedding]:
    """The embedding tables whose gradients the worker averages itself under DDP on gloo, exchanging only the rows a
    rank touched (``distributed.average_table_gradients``): every trainable table whose weight no other module
    shares (a tied decoder's gradient touches every row)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return [m for m in model.modules() if isinstance(m, torch.nn.Embedding)
            and isinstance(m.weight, torch.nn.Parameter) and m.weight.requires_grad and uses.get(id(m.weight)) == 1]


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on weight matrices and embeddings, none on biases and LayerNorm weights (vectors);
    tables with sparse gradients are left to SparseAdam (``make_optimizer``)."""
    sparse = {id(m.weight) for m in sparse_tables(model)}
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad and id(param) not in sparse:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


DENSE_SHARE = 24  # a penalised table steps whole once more than 1/24 of its rows are active (RowSparseAdam)


class RowSparseAdam(torch.optim.SparseAdam):
    """torch's SparseAdam (lazy Adam: only the rows a batch touched move), the same arithmetic and the same state,
    with the touched rows read and written by index. torch's builds a sparse tensor for each moment and adds it into
    the dense one: about 6 ms a step on 1 thread for one fastText n-gram table of 4,000 touched rows, most of a step.

    ``l2``: an L2 penalty in the loss on every row of the tables, ``l2 / 2 * |W|^2``: each step adds ``l2 * W`` to the
    gradient of every row, touched by the batch or not, before Adam's moments see it (a coupled penalty, as Adam's
    ``weight_decay``; not AdamW's decoupled decay). A row that no step has touched and that started at zero has a zero
    gradient, zero moments and stays zero, so a step moves the rows touched so far (``state["active"]``), and the
    result is that of a dense Adam step over the whole table."""

    def __init__(self, params, lr: float = 1e-3, l2: float = 0.0, **kwargs):
        super().__init__(params, lr=lr, **kwargs)
        self._dense_grads: dict[torch.Tensor, torch.Tensor] = {}  # _dense_step's gradient buffers, not state
        for group in self.param_groups:
            group.setdefault("l2", l2)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, l2 = float(group["lr"]), group["eps"], float(group.get("l2", 0.0))
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise RuntimeError("SparseAdam does not support dense gradients, please consider Adam instead")
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                grad = (-p.grad if group.get("maximize", False) else p.grad).coalesce()
                values = grad._values()
                rows = grad._indices()[0]
                if l2 > 0 and self._active(p, state, rows).sum() * DENSE_SHARE > p.size(0):
                    self._dense_step(p, state, rows, values, group, l2)
                    continue
                if l2 > 0:
                    rows, values = self._penalised(p, state, rows, values, l2)
                if values.numel() == 0:
                    continue
                old_avg = state["exp_avg"].index_select(0, rows)
                old_sq = state["exp_avg_sq"].index_select(0, rows)
                avg = values.sub(old_avg).mul_(1 - beta1).add_(old_avg)
                sq = values.pow(2).sub_(old_sq).mul_(1 - beta2).add_(old_sq)
                state["exp_avg"].index_copy_(0, rows, avg)
                state["exp_avg_sq"].index_copy_(0, rows, sq)
                step = state["step"]
                step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
                p.index_add_(0, rows, avg.div_(sq.sqrt_().add_(eps)).mul_(-step_size))
        return loss

    def _dense_step(self, p: torch.Tensor, state: dict, rows: torch.Tensor, values: torch.Tensor, group: dict, l2: float):
        """A penalised step over the whole table, once its active rows are more than a ``DENSE_SHARE``-th of it: the
        batch's rows scattered into a dense gradient and torch's fused Adam with its coupled ``weight_decay`` (a
        262,145 x 32 table: about 13 ms a step on 1 thread, where reading and writing a tenth of its rows by index
        took 32). The same arithmetic as the rows' path, but for where ``eps`` meets the bias correction (torch's
        dense Adam's place)."""
        buffer = self._dense_grads.get(p)
        if buffer is None or buffer.shape != p.shape:
            buffer = self._dense_grads[p] = torch.empty_like(p)
        buffer.zero_().index_add_(0, rows, values.to(p.dtype))
        beta1, beta2 = group["betas"]
        step = torch.tensor(float(state["step"]), device=p.device)  # this step's number (the bias correction's)
        torch._fused_adam_([p], [buffer], [state["exp_avg"]], [state["exp_avg_sq"]], [], [step], lr=float(group["lr"]),
                           beta1=beta1, beta2=beta2, weight_decay=l2, eps=group["eps"], amsgrad=False,
                           maximize=False)

    @staticmethod
    def _penalised(p: torch.Tensor, state: dict, rows: torch.Tensor, values: torch.Tensor, l2: float):
        """Every active row (nonzero weights or moments, or touched by this step's batch) and its gradient with the
        penalty added: ``l2 * W``, plus the batch's gradient where it touched the row."""
        active = RowSparseAdam._active(p, state, rows)
        every = active.nonzero().squeeze(1)
        where = torch.empty(active.numel(), dtype=torch.long, device=p.device)
        where[every] = torch.arange(every.numel(), device=p.device)
        grad = p.index_select(0, every).mul_(l2)
        grad.index_add_(0, where[rows], values.to(grad.dtype))
        return every, grad

    @staticmethod
    def _active(p: torch.Tensor, state: dict, rows: torch.Tensor) -> torch.Tensor:
        """The rows a penalised step moves: those not at zero when the penalty started (also after a resume) and every
        row a batch has touched since (``state["active"]``, kept in checkpoints)."""
        if "active" not in state:
            state["active"] = (p != 0).any(1) | (state["exp_avg_sq"] != 0).any(1)
        elif state["active"].dtype != torch.bool:  # load_state_dict casts a state's tensors to the parameter's dtype
            state["active"] = state["active"] != 0
        state["active"][rows] = True
        return state["active"]


class DenseAndSparse(torch.optim.Optimizer):
    """AdamW for the dense parameters and SparseAdam (lazy Adam: only the rows a batch touched move; no weight decay,
    but ``train.l2``'s penalty on every row) for the tables with sparse gradients, stepped as one optimiser: one
    learning-rate schedule over all their groups, one state in the checkpoint."""

    def __init__(self, dense: torch.optim.Optimizer, sparse: torch.optim.Optimizer):
        super().__init__([p for g in dense.param_groups + sparse.param_groups for p in g["params"]], dense.defaults)
        self.parts = (dense, sparse)
        self.param_groups = dense.param_groups + sparse.param_groups  # the same dicts: the schedule's lr reaches both

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"dense": self.parts[0].state_dict(), "sparse": self.parts[1].state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.parts[0].load_state_dict(state_dict["dense"])
        self.parts[1].load_state_dict(state_dict["sparse"])


class PenalisedAdamW(torch.optim.AdamW):
    """AdamW whose groups may carry ``l2``: an L2 penalty in the loss, ``l2 * W`` added to the gradients of the group's
    parameters before the step (coupled, as the tables' in RowSparseAdam; beside AdamW's decoupled ``weight_decay``)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if group.get("l2", 0.0) > 0:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(p, alpha=group["l2"])
        return super().step(closure)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, l2: float = 0.0) -> torch.optim.Optimizer:
    """AdamW, with SparseAdam beside it for the tables with sparse gradients: a step then costs what the batch's rows
    cost, not what the whole table does (and DDP all-reduces only those rows). ``l2``: a penalty in the (mean) loss on
    the weight matrices and tables, every row of them (``train.l2`` over the number of training texts)."""
    groups = parameter_groups(model, weight_decay)
    groups[0]["l2"] = l2  # the weight matrices and embeddings; no penalty on biases and LayerNorm weights
    dense = PenalisedAdamW(groups, lr=lr) if l2 > 0 else torch.optim.AdamW(groups, lr=lr)
    tables = [m.weight for m in sparse_tables(model) if m.weight.requires_grad]
    return DenseAndSparse(dense, RowSparseAdam(tables, lr=lr, l2=l2)) if tables else dense


def clip_gradients(parameters, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` that also takes sparse gradients (the norm of their coalesced rows); returns the norm."""
    params = [p for p in parameters if p.grad is not None]
    sparse = [p for p in params if p.grad.is_sparse]
    if not sparse:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    for p in sparse:
        p.grad = p.grad.coalesce()  # repeated rows summed: their values' norm is the gradient's
    dense = [p for p in params if not p.grad.is_sparse]
    norms = [p.grad.values().float().norm() for p in sparse]
    if dense:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in dense]))
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if dense:
        torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
    for p in sparse:
        p.grad.values().mul_(coef.to(p.grad.dtype))
    return total


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of one rank's epoch: dropout masks differ between ranks, and the run is reproducible from
    ``train.seed``, also after a resume (which starts at an epoch)."""
    return int(np.random.SeedSequence([seed, rank, epoch]).generate_state(1)[0])


class RankZeroOutput:
    """Progress lines for people and events for the launcher, from rank 0 only (``job``, ``info``, ``events`` set)."""

    def print(self, msg: str) -> None:
        if self.info.is_main:
            print(f"[{self.job.stage}] {msg}", flush=True)

    def emit(self, event: str, **data) -> None:
        """An event for the launcher (training.events)."""
        if self.events is not None:
            self.events.emit(event, **data)


class Trainer(RankZeroOutput):
    def __init__(self, job: WorkerJob, info: distributed.DistInfo):
        self.job, self.info = job, info
        self.out = Path(job.out_dir)
        manifest = load_manifest(job.prepared_dir)
        self.num_classes = len(manifest["labels"])
        self.family = family_of(job.model)
        init = load_checkpoint(job.init_checkpoint) if job.init_checkpoint else None  # a pruned model: its own sizes
        self.sizes = self.family.checkpoint_sizes(init) if init else self.family.sizes(manifest, job.model, job.max_len)
        torch.manual_seed(job.train.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
        model = self.family.build(job.model, self.sizes, self.num_classes)
        train_split = open_split(job.prepared_dir, "train", job.model, job.max_len, self.sizes)
        if init:
            model.load_state_dict(init["model"])
        else:  # every rank the same from the same split (a resume loads them with the weights)
            self.family.fit(model, job.model, train_split)
        if job.train.gradient_checkpointing:
            self.family.enable_gradient_checkpointing(model, job.model)
        fp16 = autocast_dtype(job.train.precision, info.device) == torch.float16
        self.scaler = torch.amp.GradScaler(info.device.type, enabled=fp16)  # fp16: losses scaled, overflow steps skipped
        if job.keep_sparsity or info.device.type == "cuda" or job.train.compile:
            # sparse gradients: not through pruning masks, nccl's all-reduce or torch.compile; dense ones instead
            for table in sparse_tables(model):
                table.sparse = False
        if job.keep_sparsity:
            for module, name in prunable_weights(model, include_embedding=True):
                torch_prune.custom_from_mask(module, name, getattr(module, name) != 0)
        self.raw_model = model.to(info.device)
        # embedding tables on gloo: averaged by distributed.average_table_gradients, the rows each rank touched in one
        # all-gather, not by DDP's all-reduce of every row (dense tables) or of each table on its own (sparse ones)
        gloo_tables = info.ddp and info.device.type == "cpu" and not job.keep_sparsity and not job.train.compile
        self.tables = row_exchange_tables(model) if gloo_tables else []
        if self.tables:
            ignore = {id(m.weight) for m in self.tables}
            DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, p in model.named_parameters() if id(p) in ignore])
            for table in self.tables:  # DDP does not broadcast them: rank 0's start (Family.fit) on every rank
                torch.distributed.broadcast(table.weight.data, src=0)
        # buffers are not broadcast each step: every rank computes its own the same way (a fastText model's feature
        # weights, 2 MB, fit from the same split; position ids), and a resume loads them on every rank (DDP's start
        # sends rank 0's once, the same values)
        self.model = DDP(self.raw_model, device_ids=[info.local_rank] if info.device.type == "cuda" else None,
                         forward_sync_buffers=False) if info.ddp else self.raw_model
        if job.train.compile:  # the training forward only; validation and checkpoints use the plain module
            self.model = torch.compile(self.model)

        self.train_set = train_split
        if job.teacher_probs:  # distillation: each batch also carries the teacher's probabilities of its rows
            self.train_set = WithTeacher(self.train_set, np.load(job.teacher_probs))
        self.val_set = open_split(job.prepared_dir, "val", job.model, job.max_len, self.sizes)
        self.class_weights = None
        if job.train.class_weights == "balanced":
            labels = self.train_set.labels
            counts = np.bincount(labels[labels >= 0], minlength=self.num_classes).astype(np.float64)  # -1: unlabelled
            weights = counts.sum() / (self.num_classes * np.maximum(counts, 1))
            self.class_weights = torch.tensor(weights, dtype=torch.float32, device=info.device)
        self.sampler = train_sampler(self.train_set, job.train, info.world_size, info.rank)
        self.loader = DataLoader(
            self.train_set, batch_size=job.train.batch_size, sampler=self.sampler,
            collate_fn=self.train_set.collate, pin_memory=info.device.type == "cuda",
        )
        t = job.train
        # train.l2: a prior's strength on the summed loss, l2 / N on the mean loss of a step
        self.optimizer = make_optimizer(self.raw_model, t.lr, t.weight_decay, t.l2 / max(1, len(self.train_set)))
        steps_per_epoch = math.ceil(len(self.loader) / t.grad_accum)
        self.total_steps = t.epochs * steps_per_epoch
        warmup = int((steps_per_epoch if t.schedule == "plateau" else self.total_steps) * t.warmup_ratio)
        self.lr_schedule = LRSchedule(self.total_steps, warmup, t.schedule, t.plateau_factor)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_schedule)
        self.log = MetricLogger(job.mlflow_run_id) if info.is_main and job.mlflow_run_id else NullLogger()
        self.events = EventWriter(Path(job.out_dir) / EVENTS_FILE) if info.is_main else None
        self.epoch, self.step, self.best, self.best_epoch, self.bad_epochs = 0, 0, None, 0, 0
        self.improving_at_end = False  # whether the last epoch run was a better one (a warning if the maximum stops it)
        self.restarts = distributed.group_restarts(info)
        self._resume()
        self.resumed_after_epoch = self.epoch
        self._saved_epoch = self.epoch if self.epoch else None  # the epoch last.pt holds (None: not written yet)
        self._saved_at, self._save_s = time.perf_counter(), 0.0
        self.epoch_rates: list[float] = []  # training samples/s of each epoch run here
        self._val_s = 0.0  # how long the last validation took (the time budget keeps room for one)

    # ---- checkpoints ----------------------------------------------------------
    def _resume(self) -> None:
        last = self.out / "last.pt"
        if not last.exists():
            return
        state = load_checkpoint(last, map_location=self.info.device)
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.step = state["epoch"], state["step"]
        self.best_epoch, self.bad_epochs = state["best_epoch"], state["bad_epochs"]
        if "best" in state:
            self.best, self.improving_at_end = state["best"], state["improving_at_end"]
        else:  # written before the loss tie-break: the best epoch's metrics are in best.pt
            best_f1 = state.get("best_f1", -1.0)
            self.best = load_checkpoint(self.out / "best.pt")["metrics"] if best_f1 >= 0 else None
            self.improving_at_end = self.bad_epochs == 0
        self.print(f"resumed from {last} after epoch {self.epoch} (restart {self.restarts})")

    def _checkpoint_due(self) -> bool:
        """Whether to write last.pt after this epoch (the same answer on every rank): after the first epoch, then once
        the training since the last write has taken CHECKPOINT_SPACING times as long as that write. Where epochs take
        longer than a write, that is every epoch; where a write outlasts an epoch (a small dataset, a large model with
        its optimiser state), checkpoints stay under about a tenth of the time, and a restart repeats at most that much."""
        if self._saved_epoch is None:
            due = True
        else:
            due = time.perf_counter() - self._saved_at >= CHECKPOINT_SPACING * self._save_s
        return distributed.broadcast_flag(due, self.info)

    def _save_last(self) -> None:
        started = time.perf_counter()
        if self.info.is_main:
            self._write_last()
        self._saved_epoch, self._saved_at = self.epoch, time.perf_counter()
        self._save_s = self._saved_at - started

    def _write_last(self) -> None:
        save_checkpoint(self.out / "last.pt", {
            "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "epoch": self.epoch, "step": self.step,
            "best": self.best, "best_epoch": self.best_epoch, "bad_epochs": self.bad_epochs,
            "improving_at_end": self.improving_at_end, "scaler": self.scaler.state_dict(),
        }, epoch=self.epoch, step=self.step)

    def _save_best(self, metrics: dict) -> None:
        clean = masked_copy(self.raw_model).cpu()
        save_checkpoint(self.out / "best.pt", {
            "model": clean.state_dict(), "model_config": self.job.model.model_dump(),
            "sizes": self.sizes, "num_classes": self.num_classes, "max_len": self.job.max_len,
            "epoch": self.epoch, "step": self.step, "metrics": metrics,
        }, epoch=self.epoch, step=self.step)

    def _export(self) -> str | None:
        """The best model in its family's standard layout (a pretrained encoder's save_pretrained folder), if any."""
        state = load_checkpoint(self.out / "best.pt")
        model = self.family.build(self.job.model, self.family.checkpoint_sizes(state), self.num_classes)
        model.load_state_dict(state["model"])
        return self.family.export(model, self.out / "export", self.job.prepared_dir, load_manifest(self.job.prepared_dir)["labels"])

    # ---- the loop -------------------------------------------------------------
    def _run_epoch(self) -> float:
        self.sampler.set_epoch(self.epoch)
        torch.manual_seed(epoch_seed(self.job.train.seed, self.info.rank, self.epoch))
        self.model.train()
        t = self.job.train
        n_batches, seen = len(self.loader), 0
        window, in_window, loss_sum, n_losses = None, 0, 0.0, 0  # losses stay on the device until they are printed
        started, report_every = time.perf_counter(), max(1, n_batches // 10)
        for i, (inputs, labels, *teacher) in enumerate(self.loader, 1):
            if self._past_deadline(ahead=self._val_s):  # the budget runs out mid-epoch: validate what there is, in time
                n_batches = i - 1
                break
            inputs, labels = to_device(inputs, self.info.device), labels.to(self.info.device, non_blocking=True)
            last_micro = i % t.grad_accum == 0 or i == n_batches
            # DDP: all-reduce gradients only on the micro-batch that steps the optimiser
            sync = self.model.no_sync() if self.info.ddp and not last_micro else contextlib.nullcontext()
            with sync:
                with autocast(t.precision, self.info.device):
                    logits = self.model(inputs).float()
                if teacher:
                    loss = kd_loss(logits, teacher[0].to(self.info.device, non_blocking=True), labels, self.job.temperature,
                                   self.job.alpha, self.class_weights, t.label_smoothing)
                else:
                    loss = F.cross_entropy(logits, labels, weight=self.class_weights, label_smoothing=t.label_smoothing)
                self.scaler.scale(loss / t.grad_accum).backward()
            window = loss.detach() if window is None else window + loss.detach()
            in_window += 1
            if last_micro:
                if self.tables:
                    distributed.average_table_gradients(self.tables, self.info.world_size)
                self.scaler.unscale_(self.optimizer)  # clipping sees the true gradients (a no-op without fp16)
                if t.grad_clip > 0:
                    clip_gradients(self.model.parameters(), t.grad_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                _fault_injection(self.info, self.step)
                if self.step % t.log_every == 0:
                    self.log.add(self.step, train_loss=loss.item(), lr=self.scheduler.get_last_lr()[0])
            seen += len(labels)
            if i % report_every == 0 or i == n_batches:
                window_loss = window.item() / in_window
                loss_sum, n_losses = loss_sum + window_loss * in_window, n_losses + in_window
                window, in_window = None, 0
                rate = seen * self.info.world_size / (time.perf_counter() - started)
                self.emit("progress", epoch=self.epoch + 1, epochs=t.epochs, fraction=i / n_batches)
                self.print(f"epoch {self.epoch + 1}/{t.epochs} [{100 * i // n_batches:3d}%] "
                           f"step {i}/{n_batches} loss {window_loss:.4f} {rate:.0f} samples/s")
        if in_window:  # the deadline cut the epoch between two reports
            loss_sum, n_losses = loss_sum + window.item(), n_losses + in_window
        self._epoch_rate = seen * self.info.world_size / (time.perf_counter() - started)
        return loss_sum / n_losses if n_losses else math.nan

    def _past_deadline(self, ahead: float = 0.0) -> bool:
        """Whether ``ahead`` seconds from now lie past the time budget; the same answer on every rank (rank 0's)."""
        if self.job.deadline is None:
            return False
        return distributed.broadcast_flag(time.time() + ahead > self.job.deadline, self.info)

    def _validate(self) -> dict:
        """Exact validation: each rank scores a disjoint slice, the predictions are gathered (no padding)."""
        started = time.perf_counter()
        try:
            return self._validate_all()
        finally:
            self._val_s = time.perf_counter() - started

    def _validate_all(self) -> dict:
        mine = list(range(self.info.rank, len(self.val_set), self.info.world_size))
        probs = predict_proba(self.raw_model, self.val_set, 256, self.info.device, mine, self.job.train.precision)
        parts = distributed.all_gather_objects((mine, probs), self.info)
        idx = np.concatenate([np.asarray(p[0], dtype=np.int64) for p in parts])
        all_probs = np.concatenate([p[1] for p in parts if len(p[1])])
        y_true = self.val_set.labels[idx]
        y_pred = all_probs.argmax(1)
        nll = -np.log(np.clip(all_probs[np.arange(len(idx)), y_true], 1e-12, None)).mean()
        return {
            "val_macro_f1": float(f1_score(y_true, y_pred, average="macro")),
            "val_accuracy": float(accuracy_score(y_true, y_pred)),
            "val_loss": float(nll),
        }

    def _stop_reason(self) -> str | None:
        if self.bad_epochs >= self.job.train.patience and self.step >= self.job.train.min_steps:
            return "converged"
        if self.epoch >= self.job.train.epochs:
            return "max_epochs"
        if self.epoch and self._past_deadline(ahead=self._last_epoch_s):  # the next epoch would end after the budget
            return "timeout"
        return None

    def train(self) -> dict:
        t = self.job.train
        self.log.set_tag("restarts", str(self.restarts))
        self._last_epoch_s = 0.0
        while (stop_reason := self._stop_reason()) is None:
            started = time.perf_counter()
            train_loss = self._run_epoch()
            val = self._validate()
            self.epoch += 1
            improved = self.improving_at_end = improves(val, self.best)
            if improved:
                self.best, self.best_epoch, self.bad_epochs = val, self.epoch, 0
                if self.info.is_main:
                    self._save_best(val)
            elif self.step >= t.min_steps:  # before min_steps an epoch without gain neither counts nor decays
                self.bad_epochs += 1
                self.lr_schedule.decay()
            epoch_s = self._last_epoch_s = time.perf_counter() - started
            self.epoch_rates.append(self._epoch_rate)
            self.log.add(self.epoch, epoch=self.epoch, train_loss_epoch=train_loss, epoch_seconds=epoch_s,
                         samples_per_second=self._epoch_rate, **val)
            if sent := self._checkpoint_due():  # checkpoint before the metrics reach MLflow: a restart never logs an epoch twice
                self._save_last()
                self.log.flush()
            # the launcher feeds it to a sweep's pruner; a trial it stops logs the epochs not yet sent (``sent``) from it
            self.emit("epoch", epoch=self.epoch, sent=sent, train_loss_epoch=train_loss, epoch_seconds=epoch_s,
                      samples_per_second=self._epoch_rate, **val)
            self.print(f"epoch {self.epoch}/{t.epochs} done in {epoch_s:.1f}s: train loss {train_loss:.4f}, "
                       f"val macro-F1 {val['val_macro_f1']:.4f}, val acc {val['val_accuracy']:.4f}"
                       + (" (best)" if improved else f" (no gain {self.bad_epochs}/{t.patience})" if self.step >= t.min_steps
                          else f" (no gain; not counted before step {t.min_steps}, train.min_steps)"))
        if self._saved_epoch != self.epoch:  # the epochs since the last checkpoint, before their metrics are sent
            self._save_last()
        # one epoch is always its own best: that says nothing about a trend (a pruning round's one fine-tune epoch)
        still_improving = stop_reason != "converged" and self.improving_at_end and self.epoch > 1
        setting = self.job.epochs_setting if stop_reason == "max_epochs" else "train.timeout_minutes"
        self.print(STOP_MESSAGES[stop_reason].format(epoch=self.epoch, best=self.best_epoch, patience=t.patience, setting=setting)
                   + (f" WARNING: validation was still improving; raise {setting}." if still_improving else ""))
        best_f1 = self.best["val_macro_f1"] if self.best else -1.0
        result = {"best_checkpoint": str(self.out / "best.pt"), "best_epoch": self.best_epoch,
                  "best_val_macro_f1": best_f1, "epochs_run": self.epoch, "steps": self.step,
                  "stop_reason": stop_reason, "still_improving": still_improving,
                  "stopped_early": stop_reason != "max_epochs", "world_size": self.info.world_size, "restarts": self.restarts,
                  "resumed_after_epoch": self.resumed_after_epoch, "epoch_samples_per_second": self.epoch_rates}
        if self.info.is_main and self.best is not None:
            result["export_dir"] = self._export()
        self.log.add(self.step, best_val_macro_f1=best_f1, best_epoch=self.best_epoch)
        self.log.set_tag("stop_reason", stop_reason)
        self.log.set_tag("still_improving", str(still_improving).lower())
        self.log.flush()
        self.emit("result", **result)
        return result


CHECKPOINT_SPACING = 10  # training time between two last.pt writes, in multiples of the last write's duration

STOP_MESSAGES = {
    "converged": "stopped after epoch {epoch}: converged (no better validation score for {patience} epochs; best epoch {best})",
    "max_epochs": "stopped after epoch {epoch}: the maximum of epochs ({setting}) was reached; best epoch {best}",
    "timeout": "stopped after epoch {epoch}: the time budget (train.timeout_minutes) ran out; best epoch {best}",
}


@record
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="WorkerJob JSON file")
    args = parser.parse_args(argv)
    job = WorkerJob.model_validate_json(Path(args.config).read_text())
    info = distributed.setup()
    monitor = None
    if info.is_main and job.mlflow_run_id:  # CPU, memory, disk, network (and GPU, with nvidia-ml-py) as system/* metrics
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(job.mlflow_run_id, resume_logging=True)  # an elastic restart goes on from its last step
        monitor.start()
    finished = False
    try:
        Path(job.out_dir).mkdir(parents=True, exist_ok=True)
        trainer = Trainer(job, info)
        trainer.print(f"{info.world_size} process(es) on {info.device.type}, {torch.get_num_threads()} thread(s) each; "
                      f"{len(trainer.train_set)} train / {len(trainer.val_set)} val texts; {trainer.total_steps} steps")
        result = trainer.train()
        finished = True
        return result
    finally:
        if monitor is not None:
            monitor.finish()
        distributed.cleanup(finished)


if __name__ == "__main__":
    main()
