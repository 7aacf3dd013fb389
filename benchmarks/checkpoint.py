"""`tfdist bench checkpoint`: what checkpointing every 100 steps costs a training step.

The job `tfdist train` runs (`training.prepare`: by default the mirrored digits
CNN on 4 logical devices) trains in alternating rounds of STEPS_PER_ROUND
steps, with and without `tfdist.Checkpoint(every_steps=100)` (a fresh
directory each round, so nothing is resumed). Step time is the mean over the
round, not the median: only one step in 100 saves, and a median would hide it.
The saves at steps 100 and 200 fall inside the timed steps. Figure: `ratio` =
mean step time with checkpoints / without (target <= 1.03). On a shared
machine rounds drift by more than a 1-in-100-steps save costs, so the result
also gives the cost from its parts, timed in the same run: `ratio_from_parts`
= 1 + (median save time) / (every_steps x median step time without saves).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Optional

from tfdist import training
from tfdist.bench.overhead import _default_config
from tfdist.timing import alternate, medians
from tfdist.callbacks import Checkpoint, Throughput
from tfdist.config.schema import Config

__all__ = ["run"]

EVERY_STEPS = 100
STEPS_PER_ROUND = 250  # saves at steps 100 and 200 are timed; the one at the end of fit is not periodic cost
TARGET_RATIO = 1.03


class _TimedCheckpoint(Checkpoint):
    """Checkpoint that records how long each of its saves took."""

    def __init__(self, *args, save_seconds: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_seconds = save_seconds

    def _save(self):
        started = time.perf_counter()
        super()._save()
        self.save_seconds.append(time.perf_counter() - started)


class _Rounds:
    """Training rounds of the job, with or without checkpoints, and what the saves cost."""

    def __init__(self, job: training.Job):
        self.job = job
        self.save_seconds: list[float] = []
        self.checkpoint_bytes = 0

    def round(self, *, checkpoint: bool):
        batch = self.job.config.train.global_batch_size

        def one_round() -> float:
            timer = Throughput(batch, warmup_steps=1)
            directory = tempfile.mkdtemp(prefix="tfdist-bench-checkpoint-")
            callbacks = [timer]
            if checkpoint:
                callbacks.append(_TimedCheckpoint(directory, every_steps=EVERY_STEPS, keep=1,
                                                  save_seconds=self.save_seconds))
            try:
                self.job.model.fit(self.job.train_data, epochs=1, steps_per_epoch=STEPS_PER_ROUND, verbose=0,
                                   shuffle=False, callbacks=callbacks)
                self.checkpoint_bytes = max(self.checkpoint_bytes, _bytes_under(directory))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            return timer.step_time_ms  # wall time per step (ms)

        return one_round


def _bytes_under(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)


def run(*, config: Optional[Config] = None, repeats: int = 5) -> dict[str, Any]:
    config = config or _default_config()
    job = training.prepare(config)
    rounds = _Rounds(job)
    samples = alternate({"plain": rounds.round(checkpoint=False), "checkpointed": rounds.round(checkpoint=True)},
                        repeats=repeats)
    median = medians(samples)
    ratio = median["checkpointed"] / median["plain"]
    save_ms = 1000 * statistics.median(rounds.save_seconds)
    return {
        "benchmark": "checkpoint",
        "strategy": config.strategy.kind,
        "num_replicas": job.strategy.num_replicas_in_sync,
        "global_batch_size": config.train.global_batch_size,
        "every_steps": EVERY_STEPS,
        "steps_per_round": STEPS_PER_ROUND,
        "repeats": repeats,
        "mean_step_time_ms": median,
        "samples": samples,
        "figures": {
            "ratio": ratio,
            "target_ratio": TARGET_RATIO,
            "meets_target": ratio <= TARGET_RATIO,
            "ratio_from_parts": 1 + save_ms / (EVERY_STEPS * median["plain"]),
            "save_ms": save_ms,
            "checkpoint_bytes": rounds.checkpoint_bytes,
        },
    }
