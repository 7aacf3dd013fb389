"""`tfdist bench ps_worker_loss`: what losing a worker costs a parameter-server job.

The job of `configs/parameter_server.yaml` (2 workers and 1 parameter server as
local processes, which restart a worker that dies) trains in alternating
rounds of STEPS_PER_ROUND steps: plain rounds, and rounds in which worker 1 is
killed with SIGKILL after a random step in the round's first half. Each round
counts the steps the parameter server applied (the optimizer's `iterations`)
against the steps scheduled, and is timed. ClusterCoordinator runs a closure
that failed with its worker again on another worker, so a step is never lost,
but one the dead worker had applied before it died is applied again. Between
rounds the killed worker is back and has trained, so a round starts with both.

Figures: `extra_steps_max` and `extra_steps_mean` (applied steps beyond those
scheduled, per kill), `lost_steps` (scheduled steps never applied; 0 is
required) and `seconds_per_kill` (median killed round minus median plain
round: the worker's restart, during which one worker trains).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import keras

from tfdist import training
from tfdist.timing import alternate, medians
from tfdist.config.loading import load_config

__all__ = ["measure"]

# configs/parameter_server.yaml's job.
JOB = [
    "strategy.kind=parameter_server", "parameter_server.num_workers=2", "parameter_server.num_ps=1",
    "parameter_server.threads_per_task=1", "train.global_batch_size=32", "train.optimizer=adam",
    "train.learning_rate=0.002", "model.width=16", "model.dropout=0.1", "train.verbose=0",
]
STEPS_PER_ROUND = 300
RESTART_TIMEOUT_SECONDS = 120


class _KillAfter(keras.callbacks.Callback):
    """SIGKILLs a local worker once training has passed batch `batch`."""

    def __init__(self, cluster, batch: int):
        super().__init__()
        self.cluster, self.batch, self.done = cluster, batch, False

    def on_train_batch_end(self, batch, logs=None):
        if not self.done and batch >= self.batch:
            self.cluster.kill("worker", 1)
            self.done = True


class _Rounds:
    def __init__(self, job: training.Job, seed: int):
        self.job = job
        self.cluster = job.strategy.local_cluster
        self.random = random.Random(seed)
        self.applied: list[int] = []  # steps applied by each killed round
        self.kill_batches: list[int] = []

    def _fit(self, steps: int, callbacks=()) -> float:
        started = time.perf_counter()
        self.job.model.fit(self.job.train_data, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
                           callbacks=list(callbacks))
        return time.perf_counter() - started

    def plain(self) -> float:
        return self._fit(STEPS_PER_ROUND)

    def killed(self) -> float:
        batch = self.random.randrange(STEPS_PER_ROUND // 8, STEPS_PER_ROUND // 2)
        restarts = self.cluster.restarts
        before = int(self.job.model.optimizer.iterations.numpy())
        seconds = self._fit(STEPS_PER_ROUND, [_KillAfter(self.cluster, batch)])
        self.applied.append(int(self.job.model.optimizer.iterations.numpy()) - before)
        self.kill_batches.append(batch)
        self._wait_for_restart(restarts)
        return seconds

    def _wait_for_restart(self, restarts: int) -> None:
        """The killed worker is running again and has trained a little, so the next round has two."""
        deadline = time.monotonic() + RESTART_TIMEOUT_SECONDS
        while self.cluster.restarts == restarts:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the killed worker was not restarted within {RESTART_TIMEOUT_SECONDS} s")
            time.sleep(0.2)
        self.cluster.wait_until_listening()
        self._fit(STEPS_PER_ROUND // 4)


def measure(*, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    config = load_config(None, JOB)
    job = training.prepare(config)
    try:
        rounds = _Rounds(job, seed)
        samples = alternate({"plain": rounds.plain, "killed": rounds.killed}, repeats=repeats)
    finally:
        job.strategy.local_cluster.stop()
    seconds = medians(samples)
    extra = [n - STEPS_PER_ROUND for n in rounds.applied]
    return {
        "benchmark": "ps_worker_loss",
        "job": JOB,
        "steps_per_round": STEPS_PER_ROUND,
        "repeats": repeats,
        "kill_after_batch": rounds.kill_batches,
        "applied_steps": rounds.applied,
        "round_seconds": seconds,
        "samples": samples,
        "figures": {
            "kills": len(rounds.applied),
            "extra_steps_max": max(extra),
            "extra_steps_mean": statistics.mean(extra),
            "lost_steps": sum(max(0, -n) for n in extra),
            "seconds_per_kill": seconds["killed"] - seconds["plain"],
            "plain_step_ms": 1000 * seconds["plain"] / STEPS_PER_ROUND,
        },
    }
