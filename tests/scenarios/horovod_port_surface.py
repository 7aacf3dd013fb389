"""The names of Horovod's TensorFlow API that tfdist's port makes for Keras 3, used on each rank of one job.

    horovodrun -np 2 -H localhost:2 --gloo python horovod_port_surface.py OUT   # OUT.rank<R>.json and .npz
    python horovod_port_surface.py OUT --reference                              # OUT.reference.npz

Each rank (under horovodrun) records what the port's names did, beside real Horovod's where both have a meaning:
the `*_op` queries eagerly and in a `tf.function`, in-place `broadcast_` of a Keras 3 variable, the Keras module's
collectives on a Keras 3 variable in a `tf.function`, an elastic `TensorFlowState` committed, restored and synced,
`broadcast_global_variables`' refusal, `BestModelCheckpoint`, and a model with `SyncBatchNormalization` trained on
uneven shares of each global batch (rank 0 two thirds, rank 1 one third) with gradients summed over the ranks.
`--reference` trains that model with Keras's `BatchNormalization` on the whole global batches in one process that
imports neither tfdist nor Horovod: the port's training must equal it.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH, STEPS, FIRST_RANKS_SHARE = 24, 5, 16


def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, (GLOBAL_BATCH * STEPS, 5)).astype("float32")
    return x, (x[:, :3] @ rng.normal(size=(3, 2))).astype("float32")


def model_with(normalization) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), normalization(momentum=0.5),
                             keras.layers.Dense(2)])


def train(normalization, share, tape_of=lambda tape: tape) -> list:
    """The model's weights (BatchNormalization's moving statistics among them) after STEPS steps of SGD on
    `share(step)`'s rows, the loss the sum of squared errors over the global batch."""
    model, x_all, y_all = model_with(normalization), *batches()
    optimizer = keras.optimizers.SGD(0.05)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / GLOBAL_BATCH
        tape = tape_of(tape)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for number in range(STEPS):
        rows = share(number)
        step(x_all[rows], y_all[rows])
    return model.get_weights()


def reference(out):
    assert "tfdist" not in sys.modules and "horovod" not in sys.modules
    weights = train(keras.layers.BatchNormalization, lambda number: slice(number * GLOBAL_BATCH,
                                                                          (number + 1) * GLOBAL_BATCH))
    np.savez(f"{out}.reference.npz", *weights)


def ranks(out):
    import horovod.tensorflow as real
    import tfdist.horovod.tensorflow as hvd
    import tfdist.horovod.tensorflow.keras as hvd_keras

    hvd.init()
    rank, found = hvd.rank(), {}

    @tf.function
    def queries():
        return [hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                hvd.process_set_included_op()]

    found["ops"] = [int(value) for value in queries()]
    found["ops_eagerly"] = [int(hvd.rank_op()), int(hvd.size_op())]
    found["built"] = {name: getattr(hvd, f"{name}_built")() for name in ("mpi", "gloo", "nccl", "cuda")}
    found["is_homogeneous"] = hvd.is_homogeneous()

    # In-place broadcast: the port takes a Keras 3 variable; Horovod's own only the tf.Variable behind it.
    variable = keras.Variable(np.full(3, rank + 1.0, "float32"))
    behind = variable.value
    hvd.broadcast_([variable], root_rank=1)
    twin = tf.Variable(np.full(3, rank + 1.0, "float32"))
    real.broadcast_([twin], root_rank=1)
    found["broadcast_"] = {"port": variable.numpy().tolist(), "horovod": twin.numpy().tolist(),
                           "same_variable": variable.value is behind}

    # Horovod Keras's collectives on a Keras 3 variable, in a tf.function, against horovod.tensorflow's on its
    # tensor.
    mine = keras.Variable(np.arange(4, dtype="float32") + 10 * rank)
    plain = tf.Variable(np.arange(4, dtype="float32") + 10 * rank)  # a tf.Variable, whose `value` is a method

    @tf.function
    def keras_collectives():
        return {"allreduce": hvd_keras.allreduce(mine), "allreduce_tf_variable": hvd_keras.allreduce(plain),
                "allgather": hvd_keras.allgather(mine),
                "broadcast": hvd_keras.broadcast(mine, root_rank=1), "reducescatter": hvd_keras.reducescatter(mine),
                "reducescatter_sum": hvd_keras.reducescatter(mine, op=hvd.Sum)}

    @tf.function
    def horovod_collectives():
        tensor = tf.convert_to_tensor(mine.value)
        return {"allreduce": real.allreduce(tensor, op=real.Average),
                "allreduce_tf_variable": real.allreduce(tensor, op=real.Average), "allgather": real.allgather(tensor),
                "broadcast": real.broadcast(tensor, root_rank=1), "reducescatter": real.reducescatter(tensor),
                "reducescatter_sum": real.reducescatter(tensor, op=real.Sum)}

    found["keras_collectives"] = {key: value.numpy().tolist() for key, value in keras_collectives().items()}
    found["horovod_collectives"] = {key: value.numpy().tolist() for key, value in horovod_collectives().items()}

    # Elastic state of a Keras 3 variable and a tf.Variable: restore goes back to the commit; sync takes rank 0's.
    kept, plain = keras.Variable([1.0, 2.0]), tf.Variable([3.0])
    state = hvd.elastic.TensorFlowState([kept, plain], epoch=rank)
    kept.assign([5.0, 6.0])
    state.commit()
    kept.assign([7.0, 8.0])
    plain.assign([9.0])
    state.restore()
    found["elastic_restored"] = [kept.numpy().tolist(), plain.numpy().tolist()]
    kept.assign([10.0 + rank, 0.0])
    state.epoch = 40 + rank
    state.sync()
    found["elastic_synced"] = [kept.numpy().tolist(), state.epoch]
    try:
        hvd.elastic.TensorFlowState()
    except ValueError as error:
        found["elastic_without_variables"] = str(error)

    for module in (hvd, hvd_keras):
        try:
            module.broadcast_global_variables(0)
        except RuntimeError as error:
            found.setdefault("broadcast_global_variables", []).append(str(error))

    found["best_model_checkpoint"] = best_model_checkpoint(hvd_keras, f"{out}.rank{rank}.best.keras")

    shares = [slice(0, FIRST_RANKS_SHARE), slice(FIRST_RANKS_SHARE, GLOBAL_BATCH)]

    def share(number):
        whole = shares[rank]
        return slice(number * GLOBAL_BATCH + whole.start, number * GLOBAL_BATCH + whole.stop)

    weights = train(hvd.SyncBatchNormalization, share, lambda tape: hvd.DistributedGradientTape(tape, op=hvd.Sum))
    np.savez(f"{out}.rank{rank}.npz", *weights)
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as file:
        json.dump(found, file)


def best_model_checkpoint(hvd_keras, path) -> dict:
    """Which epochs `BestModelCheckpoint` wrote its file in, against the epochs whose val_loss was the best yet, the
    kernel each epoch ended with and the one the file holds; and `fit` with no path."""
    x = np.linspace(-1, 1, 32, dtype="float32")[:, None]
    # The learning rate is too large for the last epochs: val_loss falls, then rises.
    rates = [0.1, 0.1, 3.0, 3.0]
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    written, kernels = [], []

    class Writes(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.model.optimizer.learning_rate.assign(rates[epoch])
            self.before = os.stat(path).st_mtime_ns if os.path.exists(path) else None

        def on_epoch_end(self, epoch, logs=None):
            kernels.append(self.model.get_weights()[0].tolist())
            if os.path.exists(path) and os.stat(path).st_mtime_ns != self.before:
                written.append(epoch)

    checkpoint = hvd_keras.callbacks.BestModelCheckpoint(filepath=path)
    history = model.fit(x, 2 * x, validation_data=(x, 2 * x), epochs=len(rates), verbose=0,
                        callbacks=[checkpoint, Writes()])
    losses = history.history["val_loss"]
    best = [epoch for epoch, loss in enumerate(losses) if loss < min(losses[:epoch], default=np.inf)]
    unset = hvd_keras.callbacks.BestModelCheckpoint()
    try:
        model.fit(x, x, epochs=1, verbose=0, callbacks=[unset])
        without_path = None
    except ValueError as error:
        without_path = str(error)
    return {"written": written, "best": best, "val_loss": losses, "without_path": without_path,
            "loaded": keras.models.load_model(path).get_weights()[0].tolist(), "kernels": kernels}


if __name__ == "__main__":
    reference(sys.argv[1]) if sys.argv[2:] == ["--reference"] else ranks(sys.argv[1])
