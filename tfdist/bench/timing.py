"""Timing two or more variants fairly: alternated in one run, medians compared.

Absolute times on shared 2-core machines drift by more than the differences we
look for, so variants run in alternating rounds (A B B A ...) after a warm-up
round each, and only ratios of medians are reported.
"""

from __future__ import annotations

import statistics
from typing import Callable, Mapping

__all__ = ["alternate", "fit_round", "medians"]


def alternate(
    variants: Mapping[str, Callable[[], float]], *, repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Runs every variant `warmup` times untimed, then `repeats` timed rounds.

    Args:
      variants: name -> a function that runs one round and returns its measured
        time (for example seconds per step).
      repeats: timed rounds per variant.
      warmup: untimed rounds per variant first (tracing, caches, autotuning).

    Returns:
      name -> the measured times, in round order.
    """
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1. Received: {repeats}")
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            samples[name].append(variants[name]())
    return samples


def medians(samples: Mapping[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def fit_round(model, dataset, *, batch: int, steps: int) -> Callable[[], float]:
    """A round for `alternate`: `model.fit` for `steps` steps; returns its wall time per step (ms),
    the first step (warm-up) left out. Slow steps (input stalls) count in full."""
    from tfdist.callbacks import Throughput  # Keras: only for the benchmarks that train

    def one_round() -> float:
        timer = Throughput(batch, warmup_steps=1)
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False, callbacks=[timer])
        return timer.step_time_ms

    return one_round
