"""One process of a 2-process pipeline or tensor-parallel job trained data parallel across processes.

`python process_group_scenarios.py BACKEND LAYOUT OUT [SHARD]`: BACKEND is `multi_worker`
(the cluster from TF_CONFIG) or `horovod` (under horovodrun), or `one_device`
for the reference; LAYOUT is `pipeline` (2 stages on this process's 2 logical
CPUs), `pipeline_2x2` (2 replicas of 2 stages on 4), `pipeline_layout` (2
stages split by a layout over 2 devices each, on 4), `layout_split` (the
pipeline's model split by those rules over 2, as a `LayoutStrategy`),
`tensor_parallel` (a group of 2) or `layout_gemma` (keras-hub's Gemma causal LM split by its own
layout map over 2, its ModelParallel made a strategy by `tfdist.strategy_from`,
which also makes a Keras DataParallel one of the launcher's). Process 0 saves the trained
weights (unsharded), the per-epoch loss, and the predictions and evaluation
loss over the training data to OUT (.npz). Every process
trains on its shard of the same global batches as the one-device reference.
With SHARD (0 to 3) the job trains with Adam, its state (at 3 its kernels
too) split over the replicas of both processes at that stage (0: unsplit); each process records
its slot and weight bytes by device, and a pipeline's processes save the
model together (`strategy.save_model`) to OUT.keras.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

REPLICAS = 2 if sys.argv[2].endswith("2x2") or sys.argv[2] == "pipeline_layout" else 1  # of 2 devices each
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2 * REPLICAS
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist._compat import graph_functions  # noqa: E402
from tfdist.layers import ColumnParallelDense, ParallelMLP, RowParallelDense  # noqa: E402
from tfdist.parallel.layout import Layout  # noqa: E402
from tfdist.strategies import LayoutStrategy, PipelineStrategy, TensorParallelStrategy  # noqa: E402
import tfdist  # noqa: E402

GLOBAL_BATCH = 16


def data(layout=""):
    if layout == "layout_gemma":  # next-token prediction on random tokens
        tokens = np.random.default_rng(0).integers(1, 64, size=(64, 9))
        return {"token_ids": tokens[:, :-1], "padding_mask": np.ones((64, 8), bool)}, tokens[:, 1:]
    x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, 64)
    return x, y


def model(layout):
    keras.utils.set_random_seed(0)
    if layout == "layout_gemma":
        import keras_hub

        backbone = keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=1, num_query_heads=4,
                                                  num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                                                  head_dim=8, dropout=0.0)
        return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    if layout.startswith("pipeline") or layout == "layout_split":
        hidden = [keras.layers.Dense(16, activation="relu", name="hidden0"),
                  keras.layers.Dense(16, activation="relu", name="hidden1"),
                  keras.layers.Dense(16, activation="tanh", name="hidden2")]
    else:
        hidden = [ColumnParallelDense(8, activation="relu"), RowParallelDense(8), ParallelMLP(16)]
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), *hidden,
                             keras.layers.Dense(3, activation="softmax")])


def strategy_for(backend, layout, shard=0):
    if backend == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if layout == "layout_gemma":
        import keras_hub

        # A JAX user's ModelParallel; the launcher (TF_CONFIG, or horovodrun's ranks) picks the data axis's backend.
        mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices=["cpu:0", "cpu:1"])
        layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        return tfdist.strategy_from(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    # hidden0's columns, then hidden1's rows, over 2 devices
    rules = ((".*hidden0/kernel", (None, "model")), (".*hidden0/bias", ("model",)),
             (".*hidden1/kernel", ("model", None)))
    if layout == "layout_split":  # the pipeline's model split by those rules over this process's 2 devices
        return LayoutStrategy(Layout(model=2, rules=rules), ["/cpu:0", "/cpu:1"], data_parallel=backend,
                              shard_optimizer=shard, keep_whole_below=64)
    if layout == "pipeline_layout":  # each stage split over 2 devices
        return PipelineStrategy(num_stages=2, num_micro_batches=2, devices=[f"/cpu:{i}" for i in range(4)],
                                boundaries=["hidden1"], verbose=False, data_parallel=backend,
                                layout=Layout(model=2, rules=rules))
    if layout.startswith("pipeline"):  # at stage 3 the kernels of 64 elements and more are split
        return PipelineStrategy(num_stages=2, num_micro_batches=2, devices=[f"/cpu:{i}" for i in range(2 * REPLICAS)],
                                balance_by="params", verbose=False, data_parallel=backend, shard_optimizer=shard,
                                keep_whole_below=64)
    return TensorParallelStrategy(["/cpu:0", "/cpu:1"], data_parallel=backend)  # Megatron's split of the model


def train(backend, layout, shard=None):
    strategy = strategy_for(backend, layout, shard or 0)
    with strategy.scope():
        trained = model(layout)
        optimizer = keras.optimizers.SGD(0.1) if shard is None else keras.optimizers.Adam(0.01)
        if layout == "layout_gemma":
            trained.compile(optimizer=optimizer, weighted_metrics=[],
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        else:
            trained.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    x, y = data(layout)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    history = trained.fit(dataset, epochs=3, verbose=0)
    weights = trained.get_weights()
    predictions = trained.predict(dataset, verbose=0)
    evaluated = trained.evaluate(dataset, verbose=0)
    return strategy, trained, weights, {"loss": history.history["loss"], "predictions": predictions,
                                        "evaluated": evaluated}


def cross_process_reductions(strategy, trained, layout):
    """Devices of the step's cross-process all-reduces: TensorFlow collectives or Horovod ops."""
    x, y = data(layout)
    batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

    @tf.function(autograph=False)  # the step as Keras builds it
    def step(iterator):
        return strategy.run(trained.train_step, args=(next(iterator),))

    graph = step.get_concrete_function(iter(batches)).graph
    ops = [op for g in (graph, *graph_functions(graph)) for op in g.get_operations()]
    return sorted({op.device.split("device:")[-1] for op in ops
                   if op.type == "CollectiveReduceV2" or op.type.startswith("HorovodGroupedAllreduce")})


def keras_data_parallel():
    """A Keras DataParallel over this process's device, as the launcher made it (tfdist.strategy_from): the
    strategy's name and replicas, and a small model's weights after 3 steps with the one-device ones."""
    x, y = data()

    def trained(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            small = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3, activation="softmax")])
            small.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        small.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).take(3), verbose=0)
        return np.concatenate([w.ravel() for w in small.get_weights()])

    strategy = tfdist.strategy_from(keras.distribution.DataParallel(devices=["cpu:0"]))
    return {"data_parallel_strategy": type(strategy).__name__, "data_parallel_replicas": strategy.num_replicas_in_sync,
            "data_parallel_weights": trained(strategy), "one_device_weights": trained(tf.distribute.get_strategy())}


def split_state(strategy, trained, out):
    """This process's optimizer slot bytes and weight bytes by device (every process writes its own
    OUT-pN.json, OUT without .npz), and for a pipeline the model saved by every process at once."""
    from tfdist.parallel.optimizer_shards import held_variables, shards_of
    from tfdist.strategies.replica_groups import bytes_by_device

    shards = shards_of(trained.optimizer)
    index, out = strategy.processes.index, out.removesuffix(".npz")
    with open(f"{out}-p{index}.json", "w") as f:
        json.dump({"slots": bytes_by_device([v for v in held_variables(trained.optimizer) if len(v.shape)]),
                   "weights": bytes_by_device(trained.trainable_variables),
                   "report": shards.report() if shards else None,
                   "ranks": list(shards.collectives.ranks) if shards else []}, f)
    if isinstance(strategy, (PipelineStrategy, LayoutStrategy)):
        strategy.save_model(trained, f"{out}.keras")


if __name__ == "__main__":
    backend, layout, out = sys.argv[1:4]
    shard = int(sys.argv[4]) if len(sys.argv) > 4 else None
    strategy, trained, weights, results = train(backend, layout, shard)
    devices = cross_process_reductions(strategy, trained, layout) if backend != "one_device" else []
    if layout == "layout_gemma" and backend == "horovod":  # a second MultiWorkerMirroredStrategy in one process
        results.update(keras_data_parallel())                # can abort its peers' collectives (TensorFlow's)
    if shard is not None and backend != "one_device":
        split_state(strategy, trained, out)
    elif shard is not None:  # the reference's optimizer state, to compare saved ones
        results["optimizer"] = np.concatenate([np.ravel(v.numpy()) for v in trained.optimizer.variables])
    if getattr(strategy, "is_chief", True):
        np.savez(out, *weights, **results, replicas=getattr(strategy, "num_replicas_in_sync", 1),
                 reduced_on=np.array(devices))
