"""Timing two or more variants fairly: alternated in one run, medians compared.

Absolute times on shared 2-core machines drift by more than the differences we
look for, so variants run in alternating rounds (A B B A ...) after a warm-up
round each, and only ratios of medians are reported.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Mapping, Optional, TextIO

__all__ = ["alternate", "medians"]


def alternate(
    variants: Mapping[str, Callable[[], Any]], *, repeats: int, warmup: int = 1,
    progress: bool = True,
) -> dict[str, list[Any]]:
    """Runs every variant `warmup` times untimed, then `repeats` timed rounds.

    Args:
      variants: name -> a function that runs one round and returns what it
        measured (for example seconds per step).
      repeats: timed rounds per variant.
      warmup: untimed rounds per variant first (tracing, caches, autotuning).
      progress: say on standard error how far the rounds are.

    Returns:
      name -> the measured times, in round order.
    """
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1. Received: {repeats}")
    names = list(variants)
    shown = _Progress(len(names), warmup + repeats, sys.stderr if progress else None)
    for _ in range(warmup):
        for name in names:
            variants[name]()
            shown.ran(name, "warm-up")
    samples: dict[str, list[Any]] = {name: [] for name in names}
    for round_index in range(repeats):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            samples[name].append(variants[name]())
            shown.ran(name, f"round {round_index + 1} of {repeats}")
    shown.done()
    return samples


class _Progress:
    """`tfdist bench: round 2 of 5, 37 of 140 runs, 4:10 so far, about 11:40 left (jobs/horovod@1gbit)`:
    redrawn in place on a terminal; in a log, a line when a round ends."""

    def __init__(self, per_round: int, rounds: int, stream: Optional[TextIO]):
        self.per_round, self.runs, self.stream, self.done_runs = per_round, per_round * rounds, stream, 0
        self.terminal = stream is not None and hasattr(stream, "isatty") and stream.isatty()
        self.started = time.monotonic()

    def ran(self, name: str, stage: str) -> None:
        self.done_runs += 1
        if self.stream is None or (not self.terminal and self.done_runs % self.per_round):
            return
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done_runs * (self.runs - self.done_runs)
        line = (f"tfdist bench: {stage}, {self.done_runs} of {self.runs} runs, {_clock(elapsed)} so far, "
                f"about {_clock(left)} left ({name})")
        self.stream.write(f"\r{line}\033[K" if self.terminal else line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.terminal:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def medians(samples: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}
