"""tf.data input pipelines from config: the stages that keep devices busy.

`input_pipeline` orders tf.data's own stages the way the tf.data performance
guide does: shard -> map (parallel) -> cache -> shuffle -> repeat -> batch ->
prefetch with the cache on, shard -> shuffle -> repeat -> map -> batch ->
prefetch with it off; each stage switched and sized from `DataConfig`:

- shard: with an `input_context` (from `strategy.distribute_datasets_from_function`),
  each worker's pipeline reads every n-th example, and batches are per replica
  (`input_context.get_per_replica_batch_size`); without one, batches are
  global and tf.distribute splits them over the replicas and shards them by
  element over workers (in-memory data has no files to shard);
- map: the preprocessing function, `map_parallelism` examples at once
  (AUTOTUNE by default), order kept;
- cache: after the map, so preprocessing runs once;
- shuffle and repeat for training: after the cache, or before the map when
  nothing is cached, so the shuffle buffer holds cheap raw examples;
- batch: training drops the remainder, so every step gives every replica the
  same batch size and replicas stay in step; evaluation keeps every example
  (tf.distribute spreads a last partial batch over the replicas);
- prefetch: batches prepared while the step runs (AUTOTUNE by default); 0
  prepares none ahead: tf.data's own optimizations that would (an injected
  prefetch, map and batch fused into one stage that runs ahead) are off too.

Example:

    >>> examples = tf.data.Dataset.from_tensor_slices((x, y))  # doctest: +SKIP
    >>> ds = input_pipeline(examples, DataConfig(), batch_size=64, training=True, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tfdist.config.schema import DataConfig

__all__ = ["dataset_fn", "input_pipeline", "steps_per_epoch", "training_dataset", "validation_dataset"]


def _tuned(value: int) -> Optional[int]:
    """Config's -1 as tf.data's AUTOTUNE."""
    return tf.data.AUTOTUNE if value == -1 else value


def input_pipeline(
    examples: tf.data.Dataset,
    config: DataConfig,
    *,
    batch_size: int,
    training: bool,
    seed: int = 0,
    map_fn: Optional[Callable] = None,
    input_context: Optional[tf.distribute.InputContext] = None,
) -> tf.data.Dataset:
    """Batches of `examples` (one element per example) through the configured stages.

    Args:
      examples: the examples, unbatched.
      config: the pipeline settings (`map_parallelism`, `cache`, `prefetch`,
        `shuffle_buffer`).
      batch_size: the global batch; per replica when `input_context` is given.
      training: shuffle, repeat forever and drop the remainder batch.
      seed: the shuffle seed.
      map_fn: preprocessing applied to each example.
      input_context: the worker's context from `distribute_datasets_from_function`.

    Raises:
      ValueError: a global batch that does not split over the replicas.
    """
    if input_context is not None:
        examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        batch_size = input_context.get_per_replica_batch_size(batch_size)
    if config.cache:
        # Preprocess once, then shuffle the cached examples afresh every epoch.
        examples = _map(examples, map_fn, config).cache()
        examples = _shuffled(examples, config, seed) if training else examples
    else:
        # Shuffle the raw examples before the map: filling the buffer then costs
        # no preprocessing, so an epoch starts without mapping a buffer's worth first.
        examples = _map(_shuffled(examples, config, seed) if training else examples, map_fn, config)
    batches = examples.batch(batch_size, drop_remainder=training)
    options = tf.data.Options()
    if config.prefetch:
        batches = batches.prefetch(_tuned(config.prefetch))
    else:  # tf.data would make batches ahead anyway: an injected tuned prefetch, a fused map-and-batch
        options.experimental_optimization.inject_prefetch = False
        options.experimental_optimization.map_and_batch_fusion = False
    if config.threads:
        options.threading.private_threadpool_size = config.threads
    return batches.with_options(options)


def _map(examples: tf.data.Dataset, map_fn: Optional[Callable], config: DataConfig) -> tf.data.Dataset:
    if map_fn is None:
        return examples
    if config.map_parallelism == 0:
        return examples.map(map_fn)
    return examples.map(map_fn, num_parallel_calls=_tuned(config.map_parallelism), deterministic=True)


def _shuffled(examples: tf.data.Dataset, config: DataConfig, seed: int) -> tf.data.Dataset:
    buffer = config.shuffle_buffer or _cardinality(examples)
    return examples.shuffle(buffer, seed=seed, reshuffle_each_iteration=True).repeat()


def dataset_fn(examples_fn: Callable[[], tf.data.Dataset], config: DataConfig, **kwargs) -> Callable:
    """A function for `strategy.distribute_datasets_from_function`: per-worker shards, per-replica batches.

    Example:

        >>> data = strategy.distribute_datasets_from_function(  # doctest: +SKIP
        ...     dataset_fn(lambda: tf.data.Dataset.from_tensor_slices((x, y)), config.data,
        ...                batch_size=config.train.global_batch_size, training=True))
        >>> model.fit(data, steps_per_epoch=steps)  # doctest: +SKIP
    """
    return lambda input_context: input_pipeline(examples_fn(), config, input_context=input_context, **kwargs)


def _cardinality(examples: tf.data.Dataset) -> int:
    count = int(examples.cardinality())
    if count < 1:
        raise ValueError(
            "`shuffle_buffer` must be set (data.shuffle_buffer) when the number of examples is unknown. "
            f"Received: 0 with cardinality {count}"
        )
    return count


def _from_arrays(x: np.ndarray, y: np.ndarray) -> tf.data.Dataset:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return tf.data.Dataset.from_tensor_slices((x, y)).with_options(options)


def training_dataset(x: np.ndarray, y: np.ndarray, global_batch_size: int, *, seed: int,
                     config: DataConfig = DataConfig()) -> tf.data.Dataset:
    """Shuffled, repeated, full global batches of the arrays, prefetched."""
    return input_pipeline(_from_arrays(x, y), config, batch_size=global_batch_size, training=True, seed=seed)


def validation_dataset(x: np.ndarray, y: np.ndarray, global_batch_size: int,
                       config: DataConfig = DataConfig()) -> tf.data.Dataset:
    """Every validation example once, in global batches."""
    return input_pipeline(_from_arrays(x, y), config, batch_size=global_batch_size, training=False)


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Full global batches in one pass over the data (at least one)."""
    return max(1, num_examples // global_batch_size)
