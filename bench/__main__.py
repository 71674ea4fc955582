"""Run the benchmarks and write BENCHMARKS.md.

    python -m bench            # everything (make bench)
    python -m bench --quick    # smaller inputs, minutes
    python -m bench --only preprocess,quality --out /tmp/B.md
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

# the temporary Prefect server a section's flow starts gets 20 s by default: too little on a busy 2-core machine
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

from bench import common, datasets, defaults, distill, gpu, orchestration, preprocess, pretrain, pretrained, pruning, quality, sweeps, tracking, training
from bench.common import cpu_name, machine, verdict

SECTIONS = {"preprocess": preprocess.run, "training": training.run, "datasets": datasets.run, "quality": quality.run, "pruning": pruning.run,
            "distill": distill.run, "distill_pretrained": distill.run_pretrained, "pretrained": pretrained.run, "pretrained_quality": pretrained.run_quality,
            "pretraining": pretrain.run, "pretraining_gain": pretrain.run_gain, "orchestration": orchestration.run, "tracking": tracking.run, "sweeps": sweeps.run,
            "defaults": defaults.run, "gpu": gpu.run}  # in this order
# too long for a plain run (about 90 and 80 min), or for a CUDA GPU only (about 12 min on an H200): --only NAME
ON_REQUEST = {"defaults", "distill_pretrained", "gpu"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller inputs (minutes instead of tens of minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (default 3)")
    parser.add_argument("--smoke", action="store_true",
                        help="--quick with the smallest inputs and 1 repeat: proves every section runs (the test suite)")
    parser.add_argument("--only", help=f"comma-separated sections of: {', '.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"), help="report file (default BENCHMARKS.md)")
    args = parser.parse_args(argv)
    if args.smoke:
        common.SMOKE, args.quick, args.repeats = True, True, 1
        if args.out == Path("BENCHMARKS.md"):  # never replace the real figures with smoke ones
            args.out = Path(".zhflow/bench-smoke.md")
            args.out.parent.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else [n for n in SECTIONS if n not in ON_REQUEST]
    if "sweeps" in names and "quality" in names:  # the quality section trains the sweeps' champion settings again
        names.remove("sweeps")
        names.insert(names.index("quality"), "sweeps")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s): {', '.join(unknown)}")
    if "gpu" in names and not gpu.torch.cuda.is_available():  # never replace the GPU figures with an empty section
        parser.error("the gpu section needs a CUDA device, and this machine has none")
    started = time.perf_counter()
    parts = {}
    for name in names:
        t0 = time.perf_counter()
        print(f"bench: {name} ...", flush=True)
        body = SECTIONS[name](args.quick, args.repeats).rstrip() + "\n"
        stamp = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
        flags = " --smoke" if args.smoke else " --quick" if args.quick else ""
        parts[name] = body + f"\n_Measured by `python -m bench{flags} --only {name}` (or a full run) on {stamp} " \
                             f"({cpu_name()}, {os.cpu_count()} cores), in {time.perf_counter() - t0:.0f} s._\n"
        print(f"bench: {name} done in {time.perf_counter() - t0:.0f}s", flush=True)
    sections = _existing_sections(args.out) if args.only else {}
    sections.update(parts)
    command = "python -m bench" + (" --smoke" if args.smoke else " --quick" if args.quick else "")
    header = [
        "# Benchmarks",
        "",
        f"`{command}` (`make bench`; `--quick` for a short run, `--only SECTION` to re-measure one section in place).",
        "",
        _machine_line(args.out if args.only else None),
        "",
        "Each alternative is measured in the same invocation, interleaved, so the ratios hold on a noisy machine.",
        "",
    ]
    ordered = [sections[n] for n in SECTIONS if n in sections]
    counted = [sections[n] for n in SECTIONS if n in sections and n not in ON_REQUEST]  # what a plain run runs
    header += [_total(counted, None if args.only else time.perf_counter() - started, args.quick), ""]
    args.out.write_text("\n".join(header) + "\n" + "\n".join(ordered), encoding="utf-8")
    print(f"bench: wrote {args.out} in {time.perf_counter() - started:.0f}s")
    return 0


def _total(sections: list[str], wall: float | None, quick: bool) -> str:
    """The time of the whole run (after --only: the sum of every section's own time) against its target."""
    own = sum(int(m) for text in sections for m in re.findall(r", in (\d+) s\._", text))
    limit, target = (600, "ten minutes") if quick else (3600, "an hour")
    if wall is None:
        what, seconds = (f"The sections' own times add up to {own / 60:.0f} min ({own} s; some were re-measured with --only; "
                          f"the sections run only on request, {', '.join(sorted(ON_REQUEST))}, not counted)"), own
    else:
        what, seconds = f"This run took {wall / 60:.0f} min ({wall:.0f} s)", wall
    return f"{what}; target under {target} on 2 cores: {verdict(seconds < limit)}."


def _machine_line(kept_from: Path | None) -> str:
    """This machine; after --only, the earlier report's line where it already names this CPU (its sections may have
    been measured on others, which it says), else this machine with the earlier line kept beside it."""
    line = f"Machine: {machine()}."
    if kept_from is None or not kept_from.is_file():
        return line
    earlier = next((l for l in kept_from.read_text(encoding="utf-8").splitlines() if l.startswith("Machine: ")), None)
    if earlier is None or earlier == line or cpu_name() in earlier:
        return earlier or line
    return f"{line[:-1]} (the sections measured before: {earlier[len('Machine: '):].rstrip('.')}; each section's last line says when)."


def _existing_sections(path: Path) -> dict[str, str]:
    """The sections of an earlier report, by name, so --only replaces just its own."""
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    found = {}
    for chunk in text.split("\n## ")[1:]:
        for name in SECTIONS:
            if f"--only {name}`" in chunk:
                found[name] = "## " + chunk.rstrip() + "\n"
    return found


if __name__ == "__main__":
    sys.exit(main())
