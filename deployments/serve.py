"""``zhflow serve``: the zhflow deployments served from one long-running process, no work pool needed.

    zhflow server &                      # or any Prefect server; then export PREFECT_API_URL as it prints
    zhflow serve                         # keep it running: schedules fire, and runs can be started from the UI

Same names, schedules and parameters as ``zhflow deploy`` (deployments/definitions.py).
"""

from __future__ import annotations

from prefect import get_client
from prefect import serve as prefect_serve
from prefect.exceptions import ObjectNotFound

from deployments.definitions import deployments


def take_over(served: list) -> list[str]:
    """Delete work-pool deployments of the same names (left by ``zhflow deploy``): served, they would keep the pool's
    settings and fail to load. Returns the names replaced."""
    replaced = []
    with get_client(sync_client=True) as client:
        for deployment in served:
            name = f"{deployment.flow_name}/{deployment.name}"
            try:
                existing = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                client.delete_deployment(existing.id)
                replaced.append(f"{name} (work pool {existing.work_pool_name})")
    return replaced


def serve(limit: int | None = None) -> None:
    """Block, running the deployments' scheduled and triggered runs in subprocesses of this process."""
    served = deployments()
    if replaced := take_over(served):
        print(f"zhflow serve: replacing the work-pool deployments {', '.join(replaced)} by served ones")
    prefect_serve(*served, limit=limit)


def main() -> None:
    serve()


if __name__ == "__main__":
    main()
