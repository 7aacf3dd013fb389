"""Where tfdist's Horovod step spends its time, against the hand-written one (part of `tfdist bench baselines`).

Run on every rank: `horovodrun -np 2 ... python benchmarks/horovod_step_parts.py OUT REPEATS STEPS KEY=VALUE ...`
(the overrides of the baselines' tfdist job). In one 2-rank job, on the same
batches, four ways to train take turns, each peeling off one layer:

- `fit`: tfdist's job (`training.prepare`) under `model.fit`, timed by Throughput;
- `train_function`: the training function fit calls (tfdist's,
  `data_parallel.multi_step_function`), called in a loop, without fit's
  loop and callbacks around it;
- `keras_train_function`: Keras's own training function for the same model,
  which tfdist's replaces, called the same way;
- `custom_loop_under_strategy`: a `GradientTape` step on the same architecture
  under the same `HorovodStrategy` (`strategy.run`, the Keras optimizer
  all-reducing through `HorovodAllReduce`), without Keras's `train_step`;
- `handwritten`: the baselines' hand-written step (`hvd.grouped_allreduce`),
  without a strategy.

Rank 0 writes each timing's samples/sec to OUT as JSON.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

__all__ = ["main"]


def main(out: str, repeats: int, steps: int, overrides: list[str]) -> None:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from tfdist import _compat, load_config, prepare
    from handwritten import LEARNING_RATE, digits_cnn, gradient_step  # beside this script
    from tfdist.callbacks import Throughput

    config = load_config(None, overrides)
    job = prepare(config)
    batch, warmup = config.train.global_batch_size, config.callbacks.throughput_warmup_steps
    strategy, model = job.strategy, job.model
    per_rank = job.train_data.unbatch().batch(batch // hvd.size(), drop_remainder=True)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def fit() -> float:
        clock = Throughput(batch, warmup_steps=warmup)
        model.fit(job.train_data, epochs=1, steps_per_epoch=warmup + steps, verbose=0, callbacks=[clock])
        return clock.samples_per_sec

    def timed(step):
        def one_round() -> float:
            for _ in range(warmup):
                step()
            start = time.perf_counter()
            for _ in range(steps):
                loss = step()
            float(tf.nest.flatten(strategy.experimental_local_results(loss))[0])
            return batch * steps / (time.perf_counter() - start)
        return one_round

    distributed = iter(strategy.experimental_distribute_dataset(job.train_data))
    keras_train_function = _compat.keras_step_function(model, "train_function")
    train_function = model.make_train_function(force=True)  # tfdist's, as fit makes it

    def parts(scope):
        with scope:
            network = digits_cnn(model.input_shape[1:], model.output_shape[-1], config.model.width)
            optimizer = keras.optimizers.Adam(LEARNING_RATE)
            optimizer.build(network.trainable_variables)
            return network, optimizer, keras.metrics.SparseCategoricalAccuracy()

    under_strategy = gradient_step(*parts(strategy.scope()), loss_fn)  # the Keras optimizer all-reduces
    handwritten = gradient_step(*parts(contextlib.nullcontext()), loss_fn,
                                all_reduce=lambda g: hvd.grouped_allreduce(g, op=hvd.Average))
    strategy_step = tf.function(lambda iterator: strategy.run(under_strategy, args=next(iterator)))
    plain_step, plain = tf.function(handwritten), iter(per_rank)
    ways = {
        "fit": fit,
        "train_function": timed(lambda: train_function(distributed)["loss"]),
        "keras_train_function": timed(lambda: keras_train_function(distributed)["loss"]),
        "custom_loop_under_strategy": timed(lambda: strategy_step(distributed)),
        "handwritten": timed(lambda: plain_step(*next(plain))),
    }
    for way in ways.values():  # trace and warm up
        way()
    samples = {name: [] for name in ways}
    for repeat in range(repeats):
        for name in (list(ways) if repeat % 2 == 0 else list(reversed(ways))):
            samples[name].append(ways[name]())
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(samples, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
