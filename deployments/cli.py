"""The ``zhflow`` command: the pipeline commands of flows/cli.py, plus the operator's ``server``, ``deploy`` and ``serve``.

    zhflow server                      # Prefect + MLflow servers on 127.0.0.1 (PostgreSQL with the database URLs)
    zhflow deploy                      # the deployments on the process work pool "zhflow" (created if missing)
    zhflow serve                       # or: serve the same deployments from this one process, no work pool
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from flows import cli as pipeline_cli

OPERATOR_COMMANDS = ("server", "deploy", "serve")


def _add_commands(sub: argparse._SubParsersAction) -> None:
    server = sub.add_parser(
        "server", help="start a Prefect server and an MLflow tracking server (127.0.0.1; SQLite or PostgreSQL)",
        description="Start a Prefect server (API and UI) and an MLflow tracking server (with artifact serving) and keep\n"
                    "them running until Ctrl-C. Database URLs come from the options or the environment; a PostgreSQL\n"
                    "password belongs in PGPASSWORD or ~/.pgpass. Missing PostgreSQL databases are created.\n\n"
                    "  zhflow server\n"
                    "  zhflow server --prefect-db postgresql://zhflow@127.0.0.1/zhflow_prefect \\\n"
                    "                --mlflow-db postgresql://zhflow@127.0.0.1/zhflow_mlflow --artifacts s3://bucket/zhflow",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    server.add_argument("--host", default=os.environ.get("ZHFLOW_SERVER_HOST", "127.0.0.1"),
                        help="interface both servers bind to (default 127.0.0.1: this machine only)")
    server.add_argument("--prefect-port", type=int, default=4200, help="Prefect API and UI port (default 4200)")
    server.add_argument("--mlflow-port", type=int, default=5000, help="MLflow tracking server and UI port (default 5000)")
    server.add_argument("--prefect-db", default=os.environ.get("ZHFLOW_PREFECT_DATABASE_URL"),
                        help="Prefect database URL, e.g. postgresql://user@host:5432/zhflow_prefect "
                             "($ZHFLOW_PREFECT_DATABASE_URL; default: SQLite in PREFECT_HOME)")
    server.add_argument("--mlflow-db", default=os.environ.get("ZHFLOW_MLFLOW_DATABASE_URL", "sqlite:///mlflow.db"),
                        help="MLflow backend store URL ($ZHFLOW_MLFLOW_DATABASE_URL; default: sqlite:///mlflow.db, the "
                             "store `zhflow run` writes without a server)")
    server.add_argument("--artifacts", default=os.environ.get("ZHFLOW_MLFLOW_ARTIFACTS", "mlartifacts"),
                        help="MLflow artifact store: a folder or an object store URI ($ZHFLOW_MLFLOW_ARTIFACTS; default mlartifacts)")
    server.add_argument("--logs", type=Path, default=Path(".zhflow/server"), help="server log folder (default .zhflow/server)")
    deploy = sub.add_parser(
        "deploy", help="create or update the scheduled deployments on a Prefect process work pool",
        description="Create the process work pool if missing, then the deployments nightly-retrain (02:00 daily),\n"
                    "weekly-sweep (03:00 Saturdays) and evaluate-champion (on demand) on it. Needs PREFECT_API_URL.\n"
                    "Runs start in this folder; MLFLOW_TRACKING_URI and ZHFLOW_HOME are passed on to them.\n\n"
                    "  zhflow deploy && prefect worker start --pool zhflow",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    deploy.add_argument("--pool", default="zhflow", help="process work pool name (default zhflow)")
    serve = sub.add_parser(
        "serve", help="serve the same deployments and schedules from this process (no work pool)",
        description="Serve nightly-retrain, weekly-sweep and evaluate-champion from this one long-running process:\n"
                    "schedules fire and UI-triggered runs start as subprocesses here. Needs PREFECT_API_URL.")
    serve.add_argument("--limit", type=int, help="flow runs at once (default: no limit; each deployment runs one at a time)")


def _need_api(command: str) -> str | None:
    if not os.environ.get("PREFECT_API_URL"):
        return (f"zhflow {command}: PREFECT_API_URL is not set; schedules need a Prefect server that outlives this "
                "command. Start one (zhflow server) and export PREFECT_API_URL=http://127.0.0.1:4200/api")
    return None


def server_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from deployments.server import Servers, ServerError, redact

    def on_term(signum, frame):  # a service manager's stop: the same clean stop as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    console = Console()
    servers = Servers(host=args.host, prefect_port=args.prefect_port, mlflow_port=args.mlflow_port,
                      prefect_db=args.prefect_db, mlflow_db=args.mlflow_db, artifacts=args.artifacts, logs=args.logs)
    console.print(f"starting Prefect (database {redact(args.prefect_db or 'SQLite in PREFECT_HOME')}) and MLflow "
                  f"(backend {redact(args.mlflow_db)}, artifacts {args.artifacts}) on {args.host} ...")
    try:
        servers.start()
    except ServerError as err:
        print(f"zhflow server: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    console.print(f"[bold]Prefect UI[/]  http://{servers._client_host}:{args.prefect_port}\n"
                  f"[bold]MLflow UI[/]   {servers.mlflow_uri}\n"
                  f"in other shells:\n  export PREFECT_API_URL={servers.prefect_api} MLFLOW_TRACKING_URI={servers.mlflow_uri}\n"
                  f"logs: {args.logs}/prefect.log, {args.logs}/mlflow.log; Ctrl-C stops both")
    try:
        gone = servers.wait()
        print(f"zhflow server: the {gone} server exited:\n{servers.tail(gone)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        servers.stop()


def deploy_command(args: argparse.Namespace) -> int:
    if message := _need_api("deploy"):
        print(message, file=sys.stderr)
        return 2
    from rich.console import Console

    from deployments.deploy import deploy

    try:
        ids, created = deploy(args.pool)
    except ValueError as err:
        print(f"zhflow deploy: error: {err}", file=sys.stderr)
        return 2
    console = Console()
    console.print(f"work pool {args.pool!r} {'created' if created else 'exists'} (type process); "
                  f"{len(ids)} deployments created or updated:")
    for line in ("train_pipeline/nightly-retrain  02:00 daily", "sweep/weekly-sweep             03:00 Saturdays",
                 "evaluate/evaluate-champion     on demand"):
        console.print("  " + line)
    console.print(f"next: start a worker from this venv:  {Path(sys.executable).parent / 'prefect'} worker start --pool {args.pool}\n"
                  "then trigger a run: Prefect UI > Deployments > nightly-retrain > Run > Custom run, or\n"
                  "  prefect deployment run train_pipeline/nightly-retrain --param preset=tiny")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    if message := _need_api("serve"):
        print(message, file=sys.stderr)
        return 2
    from deployments.serve import serve

    try:
        serve(limit=args.limit)
    except KeyboardInterrupt:
        return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, sub = pipeline_cli.build_parser()
    _add_commands(sub)
    args = parser.parse_args(argv)
    if args.command in OPERATOR_COMMANDS:
        pipeline_cli._quiet_env()
        return {"server": server_command, "deploy": deploy_command, "serve": serve_command}[args.command](args)
    return pipeline_cli.run_command(parser, args)


if __name__ == "__main__":
    sys.exit(main())
