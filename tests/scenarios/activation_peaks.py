"""The activation bytes a training step holds, as TensorFlow's CPU allocator reports them, beside the
planner's prediction: `python activation_peaks.py` prints one JSON line, run by tests/plan/test_plan.py.

A step's peak allocation (`tf.config.experimental.get_memory_info`, reset before the step) over what
was allocated before it holds the activations and also what does not grow with the batch (gradients,
the optimizer's temporaries, the input pipeline's buffers). The same job at two batch sizes takes the
latter away: the difference of the peaks over the difference of the batches is what an example holds.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The CPU allocator counts its peak only with oneDNN on: TensorFlow's default on CPUs with AVX512_VNNI,
# AVX512_BF16 or AMX; elsewhere (AVX2 alone) `reset_memory_stats("CPU:0")` raises ValueError.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import tensorflow as tf  # noqa: E402

from tfdist import training  # noqa: E402
from tfdist.config import load_config  # noqa: E402
from tfdist.plan import Cluster, Layout, profile  # noqa: E402
from tfdist.plan.predict import predict  # noqa: E402
from tfdist.plan.measure import one_device_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THREADS = ["runtime.intra_op_threads=0", "runtime.inter_op_threads=0"]  # one process, several jobs
# name: (config, overrides, two batch sizes)
JOBS = {
    "digits_cnn": ("configs/default.yaml", [], (64, 256)),
    "transformer": ("configs/tensor_parallel.yaml", [], (32, 128)),
    "mobilenet_v2": (None, ["model.name=keras.applications.MobileNetV2", "data.dataset=synthetic",
                            "data.image_size=32", "data.channels=3", "data.synthetic_examples=256"], (8, 32)),
}


def step_peak(config) -> int:
    """Bytes allocated at the fullest point of one training step, over those allocated before it."""
    job = training.prepare(config)
    job.model.fit(job.train_data, epochs=1, steps_per_epoch=2, verbose=0)  # traced, and every buffer made
    peaks = []
    for _ in range(2):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        job.model.fit(job.train_data, epochs=1, steps_per_epoch=1, verbose=0)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return min(peaks)


def main(names):
    result = {}
    for name in names:
        path, overrides, batches = JOBS[name]
        config = load_config(path and os.path.join(ROOT, path), [*overrides, *THREADS])
        model = profile(config)
        measured, predicted = [], []
        for batch in batches:
            one = one_device_config(config, batch)
            measured.append(step_peak(one))
            predicted.append(predict(model, Cluster(devices=1, device_flops=1.0), Layout(1), global_batch=batch,
                                     micro_batches=1).memory["activations"])
        examples = batches[1] - batches[0]
        result[name] = {"measured_per_example": (measured[1] - measured[0]) / examples,
                        "predicted_per_example": (predicted[1] - predicted[0]) / examples,
                        "layer_outputs_per_example": sum(layer.output_bytes_per_example for layer in model.layers),
                        "peaks": measured, "batches": batches}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:] or list(JOBS))
