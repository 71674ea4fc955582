"""Timing helpers and the machine description shared by the benchmark sections."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable


# --smoke (tests only): every section at its smallest, to prove the code runs; the figures mean nothing
SMOKE = False


# the best settings found by the last full sweeps section, trained again on the full split by the quality section
SWEEP_CHAMPION = Path(".zhflow/bench/sweep-champion.json")


def quick_size(quick, smoke):
    """A --quick input size, or a smaller one under --smoke."""
    return smoke if SMOKE else quick


@dataclass
class Timing:
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """Half the range, as a share of the median."""
        return (max(self.seconds) - min(self.seconds)) / 2 / self.median if self.median else 0.0

    def rate(self, items: int) -> str:
        return f"{items / self.median:,.0f}/s (±{100 * self.spread:.0f}%)"

    def __str__(self) -> str:
        return f"{self.median:.2f} s (±{100 * self.spread:.0f}%, n={len(self.seconds)})"


def interleaved(fns: dict[str, Callable[[], object]], times: int) -> dict[str, Timing]:
    """Alternatives run in turn (A B C A B C ...), so a noisy neighbour hits them alike."""
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(times):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - started)
    return {name: Timing(s) for name, s in seconds.items()}


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def cpu_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu


def machine() -> str:
    cpu = cpu_name()
    versions = ", ".join(f"{n} {metadata.version(n)}" for n in ("torch", "prefect", "mlflow", "jieba", "rjieba", "scikit-learn"))
    return f"{cpu}; {os.cpu_count()} cores; Python {platform.python_version()}; {versions}"
