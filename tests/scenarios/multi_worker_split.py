"""One worker of a two-process MultiWorkerMirroredStrategy job whose optimizer state (and at stage 3, weights)
is split over the workers (`shard_optimizer=1`, 2 and 3).

`python multi_worker_split.py TF_CONFIG OUT_DIR` trains `train`'s model with each optimizer of
OPTIMIZERS in turn, 4 epochs of 5 steps (global batch 32), split at stage 1, at stages 2 and 3 (those
of STAGE_2) and unsplit; every worker writes OUT_DIR/worker-N.json (its slot bytes and devices)
and the weights to OUT_DIR/worker-N-NAME.npz, worker-N-NAME-stage2.npz, worker-N-NAME-stage3.npz and
worker-N-NAME-stage0.npz, and Adam's at stage 3 with every layer recomputed (`tfdist.remat`) to
worker-N-adam-stage3-remat.npz. Adam's split job also saves a
`tfdist.Checkpoint` to OUT_DIR/checkpoint and a Keras file to OUT_DIR/together.keras
(`strategy.save_model`), every worker joining, the chief writing.
test_optimizer_shards_multi_worker.py starts two and trains the same models on one device.
"""

import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist import remat  # noqa: E402

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_excluding_biases": lambda: _adamw_excluding_biases(),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1),
    "mixed_float16_adam": lambda: keras.optimizers.Adam(0.01),  # compile adds loss scaling
}


STAGE_2 = ("adam", "mixed_float16_adam")


def _adamw_excluding_biases():
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((160, 12)).astype("float32")
    return x, x[:, :3].argmax(axis=1).astype("int32")


def train(strategy, name, epochs=4, callbacks=(), recomputed="none"):
    """The model trained with optimizer `name` under `strategy` (None: no strategy), its layers recomputing
    their forward pass as `recomputed` says (`tfdist.remat`)."""
    x, y = data()
    keras.mixed_precision.set_dtype_policy("mixed_float16" if "float16" in name else "float32")
    try:
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy else contextlib.nullcontext():
            # 12*7 + 7 + 7*3 + 3 weights: lengths 2 workers do not all divide, so slices are padded.
            model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(7, activation="tanh"),
                                      keras.layers.Dense(3, activation="softmax")])
            remat(model, recomputed)
            model.compile(optimizer=OPTIMIZERS[name](), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return model


if __name__ == "__main__":
    from tfdist import Checkpoint, MultiWorkerMirroredStrategy
    from tfdist.parallel.optimizer_shards import shards_of

    tf_config, out_dir = sys.argv[1:3]
    os.environ["TF_CONFIG"] = tf_config
    index = json.loads(tf_config)["task"]["index"]
    strategy = MultiWorkerMirroredStrategy(shard_optimizer=1, keep_whole_below=8)  # stage 3 splits the kernels
    result = {}
    for name in OPTIMIZERS:
        saving = [Checkpoint(os.path.join(out_dir, "checkpoint"), write=index == 0)] if name == "adam" else []
        model = train(strategy, name, callbacks=saving)
        shards = shards_of(model.optimizer)
        result[name] = {"iterations": int(model.optimizer.iterations.numpy()), "report": shards.report(),
                        "ranks": list(shards.collectives.ranks),
                        "slot_devices": sorted({v.value.device for copy in shards.copies for v in copy.variables})}
        np.savez(os.path.join(out_dir, f"worker-{index}-{name}.npz"), *model.get_weights())
        try:  # one worker alone cannot gather the slices
            model.save(os.path.join(out_dir, f"worker-{index}.keras"))
        except ValueError as error:
            result[name]["keras_file_refused"] = str(error)
        if name == "adam":  # every worker at once: the chief writes
            strategy.save_model(model, os.path.join(out_dir, "together.keras"))
        # Read at compile: the same job reduce-scattering its gradients (its collective does not depend on
        # the optimizer: two of them), and unsplit.
        for stage in (2, 3, 0) if name in STAGE_2 else (0,):
            strategy.shard_optimizer = stage
            model = train(strategy, name)
            np.savez(os.path.join(out_dir, f"worker-{index}-{name}-stage{stage}.npz"), *model.get_weights())
            if stage:
                result[name][f"stage_{stage}_report"] = shards_of(model.optimizer).report()
        strategy.shard_optimizer = 1
    strategy.shard_optimizer = 3  # with every layer recomputed too
    np.savez(os.path.join(out_dir, f"worker-{index}-adam-stage3-remat.npz"),
             *train(strategy, "adam", recomputed="full").get_weights())
    with open(os.path.join(out_dir, f"worker-{index}.json"), "w") as f:
        json.dump(result, f)
