"""Throughput's figures against the steps that really finished, under any strategy kind.

`python throughput_probe.py OUT KEY=VALUE ...` (alone, as one task of a cluster,
or on every rank under horovodrun) trains tfdist's job for the config overrides
with `Throughput` and, after it, `CompletedSteps`; the chief writes OUT (JSON).
In the test process: `measure(overrides)`.

`CompletedSteps` reads the optimizer's step counter, which counts applied
updates (on the parameter servers under parameter-server training), at every
point where Throughput may read its clock. `compare` takes each window
Throughput measured and the counter's values where that window opened and
closed.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from tfdist import Throughput, load_config, prepare  # noqa: E402
from tfdist.training import is_chief  # noqa: E402


class CompletedSteps(keras.callbacks.Callback):
    """(perf_counter, optimizer steps applied) at every epoch's begin and every batch's end."""

    def __init__(self):
        super().__init__()
        self.records = []

    def _record(self):
        self.records.append((time.perf_counter(), int(self.model.optimizer.iterations.numpy())))

    def on_epoch_begin(self, epoch, logs=None):
        self._record()

    def on_train_batch_end(self, batch, logs=None):
        self._record()


def measure(overrides, epochs=3):
    """Trains the config's job; returns each window's claimed samples (samples/sec x seconds) and
    the samples of the steps that finished inside it, and the same for the whole fit."""
    config = load_config(None, ["train.verbose=0", "data.validation_fraction=0.2", *overrides])
    job = prepare(config)
    batch = config.train.global_batch_size
    throughput = Throughput(batch, warmup_steps=config.callbacks.throughput_warmup_steps)
    completed = CompletedSteps()
    history = job.model.fit(job.train_data, epochs=epochs, steps_per_epoch=job.steps_per_epoch, verbose=0,
                            callbacks=[throughput, completed])
    if getattr(job.strategy, "local_cluster", None):  # a parameter-server job's own tasks
        job.strategy.local_cluster.stop()
    return compare(throughput, completed.records, history.history["samples_per_sec"], batch) | {
        "chief": is_chief(job.strategy)}


def compare(throughput, records, epoch_rates, batch):
    def steps_at(moment):  # the counter as read right after Throughput's clock, in the same callback round
        return next(steps for t, steps in records if t >= moment)

    windows = [
        {"claimed": rate * w.seconds, "completed": batch * (steps_at(w.end) - steps_at(w.start))}
        for w, rate in zip(throughput.windows, epoch_rates)
    ]
    return {
        "windows": windows,
        "total": {"claimed": throughput.samples_per_sec * throughput.measured_seconds,
                  "completed": sum(w["completed"] for w in windows)},
    }


if __name__ == "__main__":
    result = measure(sys.argv[2:])
    if result.pop("chief"):
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
