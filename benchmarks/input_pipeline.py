"""`tfdist bench input_pipeline`: a slow preprocessing map with and without tfdist.data's settings.

The map stands for a real input stage (reading and decoding from storage): each
example waits `map_ms` in a `tf.py_function` (the wait releases the CPU, as I/O
does), then is normalized. The consumer is `model.fit` on an MLP. Variants,
each `steps_per_round` steps (mean time per step or batch), alternated, medians
of the rounds compared. Every round first runs `HEAD_STEPS` untimed: the
round's start-up, and the batches the pipeline made ahead meanwhile (on a busy
host the producer's first batch can come back after several more are ready,
and those would count as made in no time):

- `plain`: the map one example at a time, no prefetch (`map_parallelism: 0`,
  `prefetch: 0`), so the step waits for every batch to be made;
- `tfdist`: `tfdist.data.input_pipeline` with parallel map and prefetch tuned
  by AUTOTUNE (the defaults) and its own pool of one thread per core
  (`threads`), so making batches does not queue behind the step's ops; the
  cache off, since a streamed or augmented input is made again every epoch;
- `producer`: the `tfdist` pipeline iterated alone (time per batch);
- `consumer`: the same training step on one batch held in memory;
- `producer_loaded`: the producer again, while the consumer's step runs beside
  it in this process (a second thread), as it does during training.

Figures: `step_vs_max_stage` = tfdist step time / the slower of producer and
consumer (1.0 when input and training fully overlap; target <= 1.1, the
tf.data guide's prefetch rule); `speedup` = plain step time / tfdist step
time. Two more variants, alternated with the others, run each pipeline's fit
under the `InputStalls` report: `input_wait_share` (the share of step time the
step waited for input, measured from the profiler's trace) beside
`expected_wait_share` = 1 - consumer / the same window's step time (medians of
the rounds). The expectation holds on an idle host only: under load the
scheduler gives a step waking from its wait a core at once, while the
consumer, busy all the time, gets its fair share and looks slower.

The training step runs on one core (one intra- and one inter-op thread), as a
GPU would take it off the host. It does not take it out of the host's
process, though, and a step computing in this process slows the producer by
itself, as a GPU's step would not: `host_interference` = producer_loaded /
producer measures that (1.10-1.16 so far), and `step_vs_loaded_producer` =
tfdist step time / producer_loaded is the overlap once it is counted (1.0:
the step waits only for the producer running as fast as it can beside the
step). Part of the interference is in every `py_function` call: on a tf.data
thread each call builds a fresh Python thread state, mapping and unmapping a
16 KB frame stack, and each unmap must interrupt the CPU that runs the step
(with a bare TF compute loop beside it, 2300 TLB shootdowns per producer
round instead of 13). That loop slows the producer 3-7% from a thread of
this process and not at all from another process.

More input threads than cores make batches faster still (4 on 2 cores:
speedup about 3.3) but overlap worse (step_vs_max_stage 1.17-1.25): producer
and step are then about equally fast and contend more.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

import numpy as np

from tfdist.callbacks.throughput import fit_round
from tfdist.timing import alternate, medians

__all__ = ["measure"]

TARGET_STEP_VS_MAX_STAGE = 1.1
HEAD_STEPS = 5


def measure(
    *, repeats: int = 5, map_ms: float = 1.0, batch: int = 64, examples: int = 4096, width: int = 512,
    steps_per_round: int = 40,
) -> dict[str, Any]:
    """Times the variants in this process (call before TensorFlow has started: it fixes the threads)."""
    import tensorflow as tf

    # The training step gets one core, as a GPU would take it off the host; the
    # input pipeline runs on tf.data's own threads on the other.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    import keras

    from tfdist.callbacks import InputStalls
    from tfdist.config.schema import DataConfig
    from tfdist.data import input_pipeline

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (examples, width), dtype=np.uint8)
    y = rng.integers(0, 10, examples, dtype=np.int32)

    def slow_map(image, label):
        def wait(value):
            time.sleep(map_ms / 1000)
            return value

        image = tf.py_function(wait, [image], tf.uint8)
        image.set_shape((width,))
        return tf.cast(image, tf.float32) / 255.0, label

    def pipeline(config: DataConfig):
        examples_ds = tf.data.Dataset.from_tensor_slices((x, y))
        return input_pipeline(examples_ds, config, batch_size=batch, training=True, seed=0, map_fn=slow_map)

    settings = {
        "plain": DataConfig(map_parallelism=0, prefetch=0, cache=False),
        "tfdist": DataConfig(cache=False, threads=os.cpu_count() or 1),
    }
    datasets = {name: pipeline(config) for name, config in settings.items()}
    in_memory = tf.data.Dataset.from_tensors((x[:batch].astype(np.float32) / 255.0, y[:batch])).repeat()

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((width,)), keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10),
    ])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def producer_round() -> float:
        iterator = iter(datasets["tfdist"])
        for _ in range(HEAD_STEPS):
            next(iterator)
        start = time.perf_counter()
        for _ in range(steps_per_round):
            next(iterator)
        return 1000 * (time.perf_counter() - start) / steps_per_round

    def loaded_producer_round() -> float:
        """The producer while the consumer's step trains in a second thread, stopped after the round."""
        started, done = threading.Event(), threading.Event()

        def after_batch(batch, logs):
            started.set()
            model.stop_training = done.is_set()

        step = threading.Thread(target=model.fit, args=(in_memory,), kwargs=dict(
            epochs=1, steps_per_epoch=10**9, verbose=0, shuffle=False,
            callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=after_batch)]))
        step.start()
        try:
            if not started.wait(timeout=120):
                raise RuntimeError("The consumer's training step did not start within 120 s.")
            return producer_round()
        finally:
            done.set()
            step.join()

    # Mean step times, like the producer's time per batch: a stall is a slow step, not an outlier.
    def timed_fit(dataset):
        return fit_round(model, dataset, batch=batch, steps=HEAD_STEPS + steps_per_round, warmup_steps=HEAD_STEPS)

    # At least 8 steps measured: in a window of 2, one slow step of a busy host halves the share.
    stall_steps = max(8, steps_per_round)

    def stall_round(dataset):
        """A round under the input-stall report: (its measured wait share, the window's ms per step)."""
        def one_round() -> tuple[float, float]:
            stalls = InputStalls(start_step=HEAD_STEPS, steps=stall_steps, verbose=False)
            model.fit(dataset, epochs=1, steps_per_epoch=HEAD_STEPS + stall_steps, verbose=0, shuffle=False,
                      callbacks=[stalls])
            return stalls.input_wait_share, stalls.step_time_ms

        return one_round

    rounds = {name: timed_fit(ds) for name, ds in datasets.items()}
    rounds["consumer"] = timed_fit(in_memory)
    rounds["producer"] = producer_round
    rounds["producer_loaded"] = loaded_producer_round
    rounds.update({f"stalls_{name}": stall_round(ds) for name, ds in datasets.items()})
    samples = alternate(rounds, repeats=repeats)
    step_ms = medians({name: times for name, times in samples.items() if not name.startswith("stalls_")})
    slower_stage = max(step_ms["producer"], step_ms["consumer"])
    step_vs_max_stage = step_ms["tfdist"] / slower_stage
    figures = {
        "step_vs_max_stage": step_vs_max_stage,
        "speedup": step_ms["plain"] / step_ms["tfdist"],
        "producer_vs_consumer": step_ms["producer"] / step_ms["consumer"],
        "host_interference": step_ms["producer_loaded"] / step_ms["producer"],
        "step_vs_loaded_producer": step_ms["tfdist"] / step_ms["producer_loaded"],
        "meets_target": step_vs_max_stage <= TARGET_STEP_VS_MAX_STAGE,
    }
    stall_check = {}
    for name in datasets:
        share, window_ms = (statistics.median(values) for values in zip(*samples[f"stalls_{name}"]))
        stall_check[name] = {"input_wait_share": share, "expected_wait_share": 1 - step_ms["consumer"] / window_ms,
                             "window_step_ms": window_ms}
    return {
        "benchmark": "input_pipeline",
        "global_batch_size": batch,
        "map": f"{map_ms} ms wait per example (tf.py_function), then normalize",
        "model": "MLP 512 -> 1024 -> 1024 -> 10, SGD",
        "settings": {name: {k: getattr(c, k) for k in ("map_parallelism", "cache", "prefetch", "threads")}
                     for name, c in settings.items()},
        "steps_per_round": steps_per_round,
        "repeats": repeats,
        "step_time_ms": step_ms,
        "input_stalls": stall_check,
        "samples": samples,
        "figures": figures,
    }
