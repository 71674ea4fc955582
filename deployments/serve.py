"""Serve the nightly retrain from one long-running process (no work pool needed).

    python -m deployments.serve        # keep it running; trigger runs from the Prefect UI too

Needs a Prefect server (``prefect server start`` and ``PREFECT_API_URL``) to
keep schedules and history between restarts.
"""

from __future__ import annotations

from prefect import serve
from prefect.schedules import Cron

from flows.pipeline import train_pipeline
from training.config import default

TIMEZONE = "Asia/Shanghai"


def nightly_retrain():
    """Every night at 02:00 (Asia/Shanghai): the default pipeline on the built-in corpus.

    At most one retrain runs at a time (concurrency_limit=1): a late run waits
    instead of training beside the next one.
    """
    return train_pipeline.to_deployment(
        name="nightly-retrain",
        schedule=Cron("0 2 * * *", timezone=TIMEZONE),
        parameters={"config": default().model_dump(), "experiment": "zhflow-nightly"},
        concurrency_limit=1,
        description="Retrain, prune, evaluate and register the default classifier on the built-in corpus.",
        tags=["zhflow", "retrain"],
    )


def main() -> None:
    serve(nightly_retrain())


if __name__ == "__main__":
    main()
