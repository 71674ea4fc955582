"""Scheduled runs: what happens to runs missed while no worker ran, and the key that makes a scheduled retrain
register at most one model.

The policy, for the runs a deployment's schedule created (runs triggered by hand are never touched):
when a scheduled run starts, the scheduled runs of the same deployment that are due and still waiting
(Scheduled or Late) are looked at together with it; only the newest of them runs, the others end Cancelled
with a message naming it. After a night without a worker, the worker comes back to one retrain, not seven.
"""

from __future__ import annotations

from datetime import datetime, timezone

from prefect import get_client, get_run_logger, task
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.runtime import flow_run
from prefect.states import Cancelled

SLOT_TAG = "zhflow.scheduled_slot"


def slot_key(run: FlowRun) -> str | None:
    """``DEPLOYMENT_ID@SCHEDULED_TIME`` for a run its deployment's schedule created; None for any other run."""
    if not (run.deployment_id and run.auto_scheduled and run.expected_start_time):
        return None
    return f"{run.deployment_id}@{run.expected_start_time.astimezone(timezone.utc).isoformat()}"


def settle_missed_runs(client, run: FlowRun, now: datetime | None = None) -> tuple[bool, list[FlowRun]]:
    """Apply the missed-runs policy from ``run``'s point of view (a sync Prefect client).

    Returns (whether ``run`` itself is superseded by a newer due run, the other runs it cancelled)."""
    if slot_key(run) is None:
        return False, []
    now = now or datetime.now(timezone.utc)
    waiting = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[run.deployment_id]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
        expected_start_time=FlowRunFilterExpectedStartTime(before_=now),
    ))
    due = [r for r in waiting if r.auto_scheduled and r.id != run.id] + [run]
    newest = max(due, key=lambda r: (r.expected_start_time, str(r.id)))
    cancelled = []
    for other in due:
        if other.id in (run.id, newest.id):
            continue
        client.set_flow_run_state(other.id, Cancelled(
            message=f"missed while no worker ran; superseded by the newer scheduled run {newest.name}"), force=True)
        cancelled.append(other)
    return newest.id != run.id, cancelled


@task(name="scheduled-slot")
def scheduled_slot() -> dict:
    """At the start of a deployment run: the missed-runs policy, and this run's slot key (None unless scheduled)."""
    if not flow_run.id:
        return {"key": None, "superseded": False, "reason": ""}
    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.id)
        superseded, cancelled = settle_missed_runs(client, run)
    if cancelled:
        logger.warning("cancelled %d missed scheduled run(s) of this deployment: %s", len(cancelled),
                       ", ".join(f"{r.name} ({r.expected_start_time:%Y-%m-%d %H:%M})" for r in cancelled))
    reason = "superseded by a newer scheduled run of this deployment that is also due" if superseded else ""
    return {"key": slot_key(run), "superseded": superseded, "reason": reason}


def skipped(slot: dict):
    """The final state of a run the policy superseded."""
    return Cancelled(message=slot["reason"])
