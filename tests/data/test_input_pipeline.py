"""tfdist.data: the configured stages, remainder handling, per-worker shards and per-replica batches."""

import dataclasses
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import tensorflow_mirrored
from tfdist.config.schema import DataConfig
from tfdist.data import dataset_fn, input_pipeline, training_dataset, validation_dataset

X = np.arange(20, dtype="float32")[:, None]
Y = np.arange(20, dtype="int32")


def _examples():
    return tf.data.Dataset.from_tensor_slices((X, Y))


def _counting_map():
    calls = []

    def count(x, y):
        calls.append(1)
        return x

    def map_fn(x, y):
        return tf.py_function(count, [x, y], tf.float32), y

    return map_fn, calls


@pytest.mark.parametrize("cache", [True, False])
def test_cache_runs_the_map_once(cache):
    map_fn, calls = _counting_map()
    ds = input_pipeline(_examples(), DataConfig(cache=cache), batch_size=5, training=True, map_fn=map_fn)
    batches = list(ds.take(8))  # two passes over 20 examples
    if cache:
        assert len(calls) == 20
    else:  # every pass maps again (prefetch may have started a third)
        assert len(calls) >= 40
    assert sorted(int(v) for b in batches[:4] for v in b[1]) == list(range(20))  # one pass: every example once


def test_without_cache_the_shuffle_buffer_fills_before_the_map():
    map_fn, calls = _counting_map()
    config = DataConfig(cache=False, map_parallelism=0, prefetch=0)
    first = next(iter(input_pipeline(_examples(), config, batch_size=5, training=True, map_fn=map_fn)))
    assert len(calls) == 5  # a batch's worth, not the buffer of 20
    assert len(set(int(v) for v in first[1])) == 5


def test_training_drops_the_remainder_and_evaluation_keeps_it():
    train = training_dataset(X, Y, 8, seed=0)
    assert all(b[0].shape[0] == 8 for b in train.take(10))
    sizes = [b[0].shape[0] for b in validation_dataset(X, Y, 8)]
    assert sizes == [8, 8, 4]


def test_parallel_map_keeps_the_order():
    def map_fn(x, y):
        return x * 2, y

    outputs = {
        parallelism: [int(v) for b in input_pipeline(_examples(), DataConfig(map_parallelism=parallelism),
                                                      batch_size=4, training=False, map_fn=map_fn) for v in b[1]]
        for parallelism in (0, 4, -1)
    }
    assert outputs[0] == outputs[4] == outputs[-1] == list(range(20))


def test_shuffle_changes_order_each_pass_but_not_with_the_seed():
    first = [int(v) for b in training_dataset(X, Y, 20, seed=1).take(2) for v in b[1]]
    again = [int(v) for b in training_dataset(X, Y, 20, seed=1).take(2) for v in b[1]]
    assert first == again and first[:20] != first[20:] and sorted(first[:20]) == list(range(20))


def test_an_input_context_shards_per_worker_and_batches_per_replica():
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    ds = input_pipeline(_examples(), DataConfig(), batch_size=8, training=False, input_context=context)
    batches = [b[1].numpy().tolist() for b in ds]
    assert batches == [[1, 3], [5, 7], [9, 11], [13, 15], [17, 19]]  # worker 1's examples, 8 / 4 per replica


def test_distribute_datasets_from_function_feeds_fit():
    strategy = tensorflow_mirrored()
    fn = dataset_fn(_examples, DataConfig(), batch_size=8, training=True, seed=0)
    data = strategy.distribute_datasets_from_function(fn)
    first = next(iter(data))
    assert [t.shape[0] for t in first[0].values] == [4, 4]
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    history = model.fit(data, steps_per_epoch=3, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_a_batch_that_does_not_split_over_replicas_is_a_clear_error():
    context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=3)
    with pytest.raises(ValueError, match="not divisible"):
        input_pipeline(_examples(), DataConfig(), batch_size=8, training=True, input_context=context)


def test_an_unknown_size_needs_a_shuffle_buffer():
    unknown = _examples().filter(lambda x, y: y >= 0)
    with pytest.raises(ValueError, match=r"`shuffle_buffer` must be set"):
        input_pipeline(unknown, DataConfig(), batch_size=4, training=True)
    ds = input_pipeline(unknown, dataclasses.replace(DataConfig(), shuffle_buffer=5), batch_size=4, training=True)
    assert next(iter(ds))[0].shape == (4, 1)


@pytest.mark.parametrize("prefetch", [0, -1])
def test_prefetch_zero_makes_no_batch_ahead(prefetch):
    map_fn, calls = _counting_map()
    config = DataConfig(prefetch=prefetch, map_parallelism=0, cache=False)
    batches = iter(input_pipeline(_examples(), config, batch_size=4, training=False, map_fn=map_fn))
    next(batches)
    # A prefetch (tf.data's own injected one included) makes the next batch at once; 30 s for a
    # starved run (Bazel's low priority), where waiting longer can only make a batch ahead show.
    deadline = time.monotonic() + (0.5 if prefetch == 0 else 30)
    while len(calls) <= 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (len(calls) > 4) == (prefetch != 0), len(calls)


def test_threads_give_the_pipeline_its_own_pool():
    shared = input_pipeline(_examples(), DataConfig(), batch_size=4, training=False)
    own = input_pipeline(_examples(), DataConfig(threads=3), batch_size=4, training=False)
    assert shared.options().threading.private_threadpool_size is None
    assert own.options().threading.private_threadpool_size == 3
