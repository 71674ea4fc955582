"""Process-group setup and cleanup, as one pair.

Under torchrun, RANK/LOCAL_RANK/WORLD_SIZE are set; run plainly, the worker
is a world of one. The backend follows the device: nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import faulthandler
import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How torchrun is to be started on several nodes (node 0's launcher sets it, and every other node's torchrun needs
# it too). By default the agents keep one TCPStore for every rendezvous round, so a restarted group finds the dead
# group's keys there, and a node whose worker died waits on them; torch's own opt-out gives each round a store of its
# own. It has a cost, which is why one node goes without it: node 0's agent picks a free port, closes it, and its
# rank 0 binds it seconds later, once the worker has started; another process may take it meanwhile (rank 0 then
# fails with "address already in use" and torchrun restarts the group). On one node the agent's own store, bound
# by the agent, serves every round, and each round's keys go under a prefix of their own (``setup``).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_env(nnodes: int) -> dict[str, str]:
    """The environment torchrun is started with for a job of ``nnodes`` machines."""
    return dict(TORCHRUN_ENV) if nnodes > 1 else {}


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:  # this process logs and checkpoints
        return self.rank == 0

    @property
    def ddp(self) -> bool:
        return self.world_size > 1


def setup(group: bool = False) -> DistInfo:
    """This process's place in the job; the process group is made for a world of several, and for a world of one
    when ``group`` asks for it (FSDP2 shards over a device mesh, which needs one even on a single GPU)."""
    faulthandler.enable()  # a rank that dies of a signal (SIGABRT, SIGSEGV) prints where every thread was
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world_size == 1 and group and not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:  # under torchrun
            _init_process_group(backend, rank, world_size)
        else:  # run plainly: a store of its own in this process
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    elif world_size > 1 and not dist.is_initialized():
        _init_process_group(backend, rank, world_size)
    return DistInfo(rank, local_rank, world_size, device)


def _init_process_group(backend: str, rank: int, world_size: int) -> None:
    timeout = timedelta(minutes=10)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # a store of this round's own (TORCHRUN_ENV)
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # the agent's store, shared by every round: this round's keys under a prefix of their own. Right on one node;
    # across nodes the restart counts differ after one node restarts, hence TORCHRUN_ENV there.
    if int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1 and rank == 0:
        print(f"[train] warning: torchrun was started without {' '.join(f'{k}={v}' for k, v in TORCHRUN_ENV.items())}; "
              "a restart of one node will leave the others waiting", flush=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                           is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"zhflow/attempt-{attempt}", client)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def group_restarts(info: DistInfo) -> int:
    """How often the group has been restarted: the most any node's agent counts (a node whose workers were
    restarted because another node's died and came back does not count that one)."""
    count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))], device=info.device)
    if info.ddp:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def cleanup(finished: bool = False) -> None:
    """Leave the process group. A rank that ``finished`` its work first waits for the others at a barrier, so no rank
    closes its sockets while a peer is still on its way out (gloo's transport thread can abort a process whose peer
    hung up under it). A failing rank leaves at once: its peers may be inside another collective, and torchrun ends
    them when this one exits."""
    if dist.is_available() and dist.is_initialized():
        if finished and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def all_gather_objects(obj, info: DistInfo) -> list:
    if not info.ddp:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_flag(flag: bool, info: DistInfo) -> bool:
    """Rank 0's decision, seen by every rank (e.g. early stopping)."""
    if not info.ddp:
        return flag
    t = torch.tensor([int(flag)], device=info.device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def average_table_gradients(tables: list[torch.nn.Embedding], world_size: int) -> None:
    """Average the gradients of embedding tables over the ranks, in place, exchanging only the rows a rank touched,
    in one all-gather for all of them. A table's gradient may be sparse (``sparse=True``: fastText's tables) or
    dense (the other families' vocabulary tables, whose untouched rows are zero); it stays what it was.

    DDP all-reduces every row of a dense table, although a batch touches a fraction of them (32 texts: about 1,100 of
    the default textcnn's 6,133 rows on 1,500 training texts); and
    it all-reduces each sparse table on its own, which gloo does in several collectives per table (sizes, indices,
    values). Here each rank sends the rows it touched: the row counts first (one small all-gather), then every table's
    row ids (int32, their bits carried as float32) and values in one flat tensor, padded to the longest rank's. Every
    rank sums the same gathered rows in the same order, so the tables stay identical across ranks; a row no rank
    touched stays zero, as it would after an all-reduce."""
    params = [t.weight for t in tables]
    idx, vals = [], []
    for p in params:
        if p.grad is None:
            idx.append(torch.empty(0, dtype=torch.int32))
            vals.append(p.new_empty((0, *p.shape[1:]), dtype=torch.float32))
        elif p.grad.is_sparse:
            g = p.grad.coalesce()
            idx.append(g.indices()[0].to(torch.int32))
            vals.append(g.values().float())
        else:
            rows = p.grad.reshape(len(p.grad), -1).abs().amax(dim=1).ne(0).nonzero().squeeze(1)  # NaN rows too
            idx.append(rows.to(torch.int32))
            vals.append(p.grad.index_select(0, rows).float())
    counts = torch.tensor([len(i) for i in idx], dtype=torch.int64)
    all_counts = [torch.empty_like(counts) for _ in range(world_size)]
    dist.all_gather(all_counts, counts)
    widths = [math.prod(p.shape[1:]) for p in params]
    lengths = [int(sum(int(c[k]) * (1 + widths[k]) for k in range(len(params)))) for c in all_counts]
    payload = torch.cat([i.view(torch.float32) for i in idx] + [v.reshape(-1) for v in vals])
    payload = torch.cat([payload, payload.new_zeros(max(lengths) - len(payload))])
    gathered = [torch.empty_like(payload) for _ in range(world_size)]
    dist.all_gather(gathered, payload)
    rows: list[list[torch.Tensor]] = [[] for _ in params]
    values: list[list[torch.Tensor]] = [[] for _ in params]
    for c, flat in zip(all_counts, gathered):
        c = [int(n) for n in c]
        at = 0
        for k, n in enumerate(c):
            rows[k].append(flat[at:at + n].contiguous().view(torch.int32))
            at += n
        for k, n in enumerate(c):
            values[k].append(flat[at:at + n * widths[k]].view(n, *params[k].shape[1:]))
            at += n * widths[k]
    for k, (table, p) in enumerate(zip(tables, params)):
        ids = torch.cat(rows[k]).long()
        if not len(ids):  # no rank touched it
            p.grad = None if table.sparse or p.grad is None else p.grad.zero_()
            continue
        total = torch.cat(values[k]).div_(world_size).to(p.dtype)
        if not table.sparse:
            p.grad = (torch.zeros_like(p) if p.grad is None else p.grad.zero_()).index_add_(0, ids, total)
        else:
            p.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), total, p.shape).coalesce()
