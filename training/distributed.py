"""Process-group setup and cleanup, as one pair.

Under torchrun, RANK/LOCAL_RANK/WORLD_SIZE are set; run plainly, the worker
is a world of one. The backend follows the device: nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import faulthandler
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How torchrun is to be started (the launcher sets it, and every other node's torchrun needs it too).
# By default the agents keep one TCPStore for every rendezvous round, so a restarted group finds the
# dead group's keys there; torch's own opt-out gives each round a store of its own on a fresh port.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


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


def setup() -> DistInfo:
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
    if world_size > 1 and not dist.is_initialized():
        timeout = timedelta(minutes=10)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # a torchrun started without TORCHRUN_ENV: one store for every attempt, so a per-attempt prefix.
            # Right on one node; across nodes the restart counts differ after one node restarts.
            if int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1 and rank == 0:
                print(f"[train] warning: torchrun was started without {' '.join(f'{k}={v}' for k, v in TORCHRUN_ENV.items())}; "
                      "a restart of one node will leave the others waiting", flush=True)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                   is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"zhflow/attempt-{attempt}", client)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    return DistInfo(rank, local_rank, world_size, device)


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
