"""What a hard kill leaves behind, found and settled when the next run starts.

A SIGKILL (or power loss) of the flow process runs no hook: its MLflow runs stay RUNNING, its Prefect flow
run stays Running, and its torchrun job, started in a session of its own, trains on with nobody to read it.

Every MLflow run zhflow creates carries the tag ``zhflow.owner`` = ``HOST:PID:START:BOOT:PIDNS`` (the flow
process; its start time in clock ticks since boot, so a reused PID is not mistaken for it; the boot id and the PID
namespace, so that containers sharing a host name do not judge each other's PIDs), and every process it launches
carries the same value in ``$ZHFLOW_OWNER``. ``recover()`` (the first thing ``open_pipeline_run`` does) then:

- ends the processes whose owner is gone (SIGTERM, SIGKILL after a grace period; a whole process group only when
  its leader is one of them, as torchrun's is, and never this process's own group);
- marks the RUNNING runs whose owner is gone FAILED, with a ``zhflow.failure`` tag saying so;
- sets their Prefect flow run, if still Running and not the flow run now starting, to Crashed with the same message.

"Gone" is only ever decided for owners of this host, boot and PID namespace: runs and processes of live owners,
of other machines or containers, and from before a reboot are never touched (mark those by hand). Recovery is
best effort: what cannot be settled is logged and the new run goes ahead.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

OWNER_TAG = "zhflow.owner"
OWNER_ENV = "ZHFLOW_OWNER"
FAILURE_TAG = "zhflow.failure"
GRACE_SECONDS = 10.0

log = logging.getLogger(__name__)


def _start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None if there is no such
    process (or only its zombie is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]


@lru_cache(maxsize=1)
def _machine() -> str:
    """``BOOT:PIDNS``: this boot of this machine and the PID namespace PIDs are counted in ('?' where unknown)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "?:?"
    return f"{boot}:{pidns}"


@lru_cache(maxsize=1)
def _this_owner(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid) or '?'}:{_machine()}"


def owner() -> str:
    """``HOST:PID:START:BOOT:PIDNS`` of this process."""
    return _this_owner(os.getpid())


def owner_gone(value: str) -> bool:
    """True only when ``value`` names a process of this host, boot and PID namespace that no longer runs (a PID
    now reused counts as gone)."""
    parts = value.split(":")
    if len(parts) != 5 or parts[0] != socket.gethostname() or ":".join(parts[3:]) != _machine() or "?" in parts[3:]:
        return False  # another machine, container or boot, or no way to tell: leave it
    pid, start = parts[1], parts[2]
    return pid.isdigit() and _start_ticks(int(pid)) != start


def orphans() -> dict[int, str]:
    """Processes of this host whose ``$ZHFLOW_OWNER`` names a process that is gone: ``{pid: owner}``."""
    found = {}
    marker = f"{OWNER_ENV}=".encode()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for item in environ.split(b"\0"):
            if item.startswith(marker):
                value = item[len(marker):].decode(errors="replace")
                if owner_gone(value):
                    found[int(entry.name)] = value
                break
    return found


def end_orphans(grace: float = GRACE_SECONDS) -> dict[int, str]:
    """End the orphans: SIGTERM, then SIGKILL after ``grace`` seconds. Returns those that are gone now."""
    found = orphans()
    starts = {pid: _start_ticks(pid) for pid in found}
    own_group = os.getpgrp()
    groups = set()
    for pid in found:
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if group in found and group != own_group:  # a group led by an orphan (torchrun and its workers): all of it
            groups.add(group)

    def alive(pid: int) -> bool:
        return starts[pid] is not None and _start_ticks(pid) == starts[pid]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in found:  # the others one by one (a temporary Prefect server left in the killed shell's group)
            if alive(pid):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(alive(pid) for pid in found):
            time.sleep(0.2)
        if not any(alive(pid) for pid in found):
            break
    return {pid: value for pid, value in found.items() if not alive(pid)}


def abandoned_runs(client) -> list:
    """RUNNING MLflow runs of this host whose owner process is gone."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    runs = client.search_runs(
        experiments, filter_string=f"attributes.status = 'RUNNING' and tags.`{OWNER_TAG}` LIKE '{socket.gethostname()}:%'",
        max_results=10_000)
    return [run for run in runs if owner_gone(run.data.tags[OWNER_TAG])]


def _crash_flow_run(flow_run_id: str, message: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and not run.state.is_final():
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)


def recover(client=None) -> dict[str, list]:
    """Settle what killed zhflow processes of this host left behind; returns the ended PIDs and the failed run ids."""
    from mlflow.tracking import MlflowClient
    from prefect.runtime import flow_run

    ended = end_orphans()
    for pid, value in ended.items():
        log.warning("ended process %d: its zhflow process (%s) is gone", pid, value)
    client = client or MlflowClient()
    failed, crashed, now = [], {str(flow_run.id)}, datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    for run in abandoned_runs(client):
        value = run.data.tags[OWNER_TAG]
        message = (f"the zhflow process {value.split(':')[1]} on {value.split(':')[0]} ended without closing this run "
                   f"(killed or crashed); marked FAILED by the next zhflow start at {now}")
        try:
            client.set_tag(run.info.run_id, FAILURE_TAG, message)
            client.set_terminated(run.info.run_id, "FAILED")
        except Exception as err:  # deleted meanwhile, a busy store: the new run goes ahead regardless
            log.warning("could not mark MLflow run %s FAILED: %s", run.info.run_id, err)
            continue
        failed.append(run.info.run_id)
        log.warning("MLflow run %s (%s) was left RUNNING by a process that is gone: marked FAILED",
                    run.info.run_id, run.info.run_name)
        # a retried flow run keeps its id: the one starting now is never marked
        if (flow_run_id := run.data.tags.get("prefect.flow_run_id")) and flow_run_id not in crashed:
            crashed.add(flow_run_id)
            try:
                _crash_flow_run(flow_run_id, message)
            except Exception as err:  # the Prefect API may be another one now: the MLflow side is what matters
                log.info("could not mark Prefect flow run %s Crashed: %s", flow_run_id, err)
    return {"ended_processes": sorted(ended), "failed_runs": failed}
