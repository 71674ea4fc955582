"""Run the benchmarks and write BENCHMARKS.md.

    python -m bench            # everything (make bench)
    python -m bench --quick    # smaller inputs, minutes
    python -m bench --only preprocess,quality --out /tmp/B.md
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import preprocess, quality, training
from bench.common import machine

SECTIONS = {"quality": quality.run, "preprocess": preprocess.run, "training": training.run}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller inputs (minutes instead of tens of minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (default 3)")
    parser.add_argument("--only", help=f"comma-separated sections of: {', '.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"), help="report file (default BENCHMARKS.md)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s): {', '.join(unknown)}")
    started = time.perf_counter()
    parts = []
    for name in names:
        t0 = time.perf_counter()
        print(f"bench: {name} ...", flush=True)
        parts.append(SECTIONS[name](args.quick, args.repeats))
        print(f"bench: {name} done in {time.perf_counter() - t0:.0f}s", flush=True)
    command = "python -m bench" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    header = [
        "# Benchmarks",
        "",
        f"Written by `{command}` (`make bench`) on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"in {time.perf_counter() - started:.0f} s.",
        "",
        f"Machine: {machine()}.",
        "",
        "Each alternative is measured in the same invocation, interleaved, so the ratios hold on a noisy machine.",
        "",
    ]
    args.out.write_text("\n".join(header + parts), encoding="utf-8")
    print(f"bench: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
