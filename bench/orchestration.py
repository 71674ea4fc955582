"""Orchestration overhead: a whole `zhflow run` (tiny preset, 1 process) against the same stage functions called
directly in one Python process, and where the extra seconds go (Prefect's temporary server, MLflow run
creation, torchrun launches). Every measurement is a fresh process with fresh stores, interleaved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Timing, verdict

PY = sys.executable


def direct(tmp: str) -> None:
    """The tiny pipeline's work with no Prefect, no MLflow, no torchrun: prepare, train, evaluate, prune,
    fine-tune, evaluate, baseline; the worker runs in this process."""
    from training.baseline import fit_baseline
    from training.checkpoint import save_checkpoint
    from training.job import WorkerJob
    from training.presets import tiny
    from training.data.prepare import prepare_dataset
    from training.evaluate import load_model, split_macro_f1
    from training.prune import prune
    from training.worker import main as worker

    cfg, root = tiny(), Path(tmp)
    prepare_dataset(cfg.data, cfg.preprocess, root / "prepared")

    def train(stage, model_cfg, train_cfg, **extra) -> str:
        job = WorkerJob(stage=stage, prepared_dir=str(root / "prepared"), out_dir=str(root / stage), model=model_cfg,
                        train=train_cfg, max_len=cfg.preprocess.max_len, **extra)
        (root / f"{stage}.json").write_text(job.model_dump_json())
        return worker(["--config", str(root / f"{stage}.json")])["best_checkpoint"]

    def evaluate(checkpoint: str) -> float:
        model, model_cfg, _ = load_model(checkpoint)
        return split_macro_f1(model, model_cfg, root / "prepared", "test", cfg.preprocess.max_len)

    best = train("train", cfg.model, cfg.train)
    evaluate(best)
    model, model_cfg, state = load_model(best)
    model, small = prune(model, model_cfg, cfg.prune.method, cfg.prune.amount, cfg.prune.include_embedding)
    save_checkpoint(root / "pruned.pt", {**state, "model": model.state_dict(), "model_config": small.model_dump()})
    tuned = train("finetune", small, cfg.train.model_copy(update={"epochs": cfg.prune.finetune_epochs, "lr": cfg.prune.finetune_lr}),
                  init_checkpoint=str(root / "pruned.pt"), keep_sparsity=True)
    evaluate(tuned)
    rows = [json.loads(line) for line in (root / "prepared" / "train.jsonl").open(encoding="utf-8")]
    fit_baseline([r["clean"] for r in rows], [r["label"] for r in rows])


def _timed(cmd: list[str], env: dict, cwd: str) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def run(quick: bool, repeats: int) -> str:
    zhflow = str(Path(PY).with_name("zhflow"))
    root = str(Path(__file__).resolve().parents[1])
    probes = {
        "zhflow run (Prefect + MLflow + torchrun)": lambda tmp: [zhflow, "run", "--preset", "tiny", "--nproc", "1"],
        "same stages, one process": lambda tmp: [PY, "-c", f"from bench.orchestration import direct; direct({tmp!r})"],
        "Python + imports (flows.pipeline)": lambda tmp: [PY, "-c", "import flows.pipeline"],
        "Python + imports + a one-task flow (temporary Prefect server)": lambda tmp: [
            PY, "-c", "import flows.pipeline; from prefect import flow, task; flow(lambda: task(lambda: 1)())()"],
        "MLflow: a new SQLite store, experiment and run with every setting": lambda tmp: [PY, "-c", (
            "import flows.pipeline; from mlflow.entities import Param; from mlflow.tracking import MlflowClient;"
            "from training.config import flatten; from training.presets import tiny; c = MlflowClient();"
            "r = c.create_run(c.create_experiment('x')).info.run_id;"
            "c.log_batch(r, params=[Param(k, str(v)) for k, v in flatten(tiny()).items()])")],
        "torchrun launch of a no-op (1 process, standalone)": lambda tmp: [
            PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--no-python", "true"],
    }
    seconds: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(1 if quick else max(1, repeats)):  # interleaved, each in a fresh folder and fresh stores
        for name, command in probes.items():
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db", ZHFLOW_HOME=f"{tmp}/home",
                           PREFECT_HOME=f"{tmp}/prefect", PREFECT_SERVER_ANALYTICS_ENABLED="false",
                           # as zhflow sets it: the temporary server's 20 s default is too short on a busy machine
                           PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
                           PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
                env.pop("PREFECT_API_URL", None)
                seconds[name].append(_timed(command(tmp), env, tmp))
    t = {name: Timing(v) for name, v in seconds.items()}
    names = list(probes)
    full, alone, imports, prefect, mlflow_run, torchrun = (t[n].median for n in names)
    extra = full - alone
    parts = {"temporary Prefect server and the flow/task machinery": prefect - imports,
             "MLflow store, runs and params (the pipeline opens about 10 runs)": mlflow_run - imports,
             "torchrun launches (train and fine-tune: 2)": 2 * torchrun}
    rows = [f"| {name} | {t[name]} |" for name in names]
    return "\n".join([
        "## Orchestration overhead",
        "",
        f"Wall time of fresh processes on the tiny preset (600 texts, 1 training process), "
        f"{len(seconds[names[0]])} interleaved run(s) each, median (± half the range).",
        "",
        "| what | seconds |",
        "|---|---|",
        *rows,
        "",
        f"- `zhflow run` takes {extra:+.1f} s over the same work in one process ({full:.1f} s against {alone:.1f} s; "
        f"target: the extra under 60 s on the tiny preset: {verdict(extra < 60)}). Where it goes, from the probes above:",
        *[f"  - {what}: about {value:.1f} s" for what, value in parts.items()],
        "  - the rest: the workers' own Python start and imports (a process each), registering the pyfunc model "
        "(logged with its code and artifacts), the dataset inputs, artifacts and plots each stage logs, the latency "
        "measurements of the prune report, and the per-epoch metric flushes.",
        "",
    ])
