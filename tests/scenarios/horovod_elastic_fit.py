"""An elastic Horovod Keras script, written the way Horovod's elastic Keras MNIST example is, on Keras 3.

`python horovod_elastic_fit.py OUT_DIR` under `horovodrun --min-np 1 --max-np 2
--host-discovery-script ...`. It trains on digits for EPOCHS epochs of STEPS
batches with `KerasState` and the elastic callbacks, committing every batch.
Each process appends what it saw to OUT_DIR/events.<pid>.jsonl: its start,
every commit (the optimizer's step), every reset (the step restored) and the
end of its first batch after one; the last rank 0 writes OUT_DIR/result.json
(the optimizer's final step, the ranks left, the validation accuracy).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tfdist.data import load_digits  # noqa: E402  (the digits data, which tfdist ships)

import tfdist.horovod.tensorflow.keras as hvd  # noqa: E402  (was: import horovod.tensorflow.keras as hvd)

EPOCHS = 6
STEPS = 15
BATCH = 32
LEARNING_RATE = 0.01


def main(out_dir):
    log = open(os.path.join(out_dir, f"events.{os.getpid()}.jsonl"), "a", buffering=1)

    def event(kind, **fields):
        log.write(json.dumps({"event": kind, "time": time.time(), "rank": hvd.rank(), "size": hvd.size(),
                              "host": os.environ.get("HOROVOD_HOSTNAME"), **fields}) + "\n")

    hvd.init()
    event("start", pid=os.getpid())
    pixels, labels = load_digits()
    images = (pixels / 16.0).astype("float32")[..., np.newaxis]
    order = np.random.default_rng(0).permutation(len(images))
    train_rows, val_rows = order[:1400], order[1400:]

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    # Horovod: scale the learning rate by the number of ranks; all-reduce the gradients.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(LEARNING_RATE * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    steps = lambda: int(model.optimizer.iterations.numpy())  # noqa: E731

    class Events(keras.callbacks.Callback):
        after_reset = False

        def on_train_batch_end(self, batch, logs=None):
            if self.after_reset:
                event("first_batch_after_reset", step=steps())
                self.after_reset = False

    events = Events()

    def on_state_reset():
        # Horovod: the learning rate follows the number of ranks that are left.
        model.optimizer.learning_rate = LEARNING_RATE * hvd.size()  # Keras 3: no `optimizer.lr`
        event("reset", restored_step=steps(), batch=state.batch, epoch=state.epoch)
        events.after_reset = True

    state.register_reset_callbacks([on_state_reset])
    save = state.save

    def logged_save():  # a commit saves, then checks for new or lost hosts
        save()
        event("commit", step=steps())

    state.save = logged_save

    callbacks = [
        hvd.callbacks.MetricAverageCallback(),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state),
        events,
    ]

    @hvd.elastic.run
    def train(state):
        # Horovod: each rank reads its own shard of the ranks there are now.
        dataset = tf.data.Dataset.from_tensor_slices((images[train_rows], labels[train_rows]))
        dataset = dataset.shard(hvd.size(), hvd.rank()).repeat().shuffle(1000, seed=0).batch(BATCH)
        state.model.fit(dataset, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)

    train(state)
    _, accuracy = model.evaluate(images[val_rows], labels[val_rows], verbose=0)
    event("end", step=steps(), val_accuracy=float(accuracy))
    if hvd.rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"final_step": steps(), "size": hvd.size(), "val_accuracy": float(accuracy)}, f)


if __name__ == "__main__":
    main(sys.argv[1])
