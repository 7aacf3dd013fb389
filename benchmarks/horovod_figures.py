"""`tfdist bench horovod`: scaling of 2 Horovod ranks over 1, and all-reduce calls per step.

Scaling: `tfdist train` jobs with strategy.kind=horovod under
`horovodrun -np 1` and `-np 2`, alternated, each rank pinned to its own core
with one intra-op thread, the same batch per rank (weak scaling, as Horovod
measures), on a compute-bound convolutional model (synthetic images).
`scaling_efficiency_np2` = samples/sec(np 2) / (2 x samples/sec(np 1)).

All-reduce calls: the same 2-rank job with Horovod's trace log on, once with
tensor fusion at `fusion_threshold_bytes` and once with fusion off (threshold 0).
Every fused all-reduce Horovod performs is one response in its "Sending ready
responses" lines; the gradient responses divided by the training steps are the
calls per step. `allreduce_calls_bound` = ceil(gradient bytes / threshold) + 1.

Custom loops: in one 2-rank job, `tfdist.horovod.tensorflow`'s
`DistributedGradientTape` loop and a hand-written loop calling Horovod's
`grouped_allreduce` on the gradients take turns on the same model and images
(`benchmarks/horovod_custom_loop.py`). `custom_loop_ratio` = samples/sec(tape) /
samples/sec(grouped_allreduce), medians.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from tfdist.bench.jobs import HOROVODRUN, described, horovod_launcher, run_train, script, train_job
from tfdist.timing import alternate, medians

__all__ = ["count_gradient_allreduces", "custom_loops", "measure"]

TARGET_EFFICIENCY = 0.92
TARGET_CUSTOM_LOOP_RATIO = 0.98
_RESPONSES = re.compile(r"Sending ready responses as (.*)$")


def measure(*, repeats: int = 5, per_rank_batch: int = 256, image_size: int = 16, width: int = 32,
            epochs: int = 2, steps_per_epoch: int = 20, fusion_threshold_bytes: int = 1 << 20) -> dict[str, Any]:
    setting = [
        "strategy.kind=horovod", "train.verbose=0", "data.dataset=synthetic", f"data.image_size={image_size}",
        "data.synthetic_examples=4096", "model.name=digits_cnn", f"model.width={width}",
        "runtime.intra_op_threads=1", "runtime.inter_op_threads=2", "callbacks.throughput_warmup_steps=10",
    ]
    jobs = {
        f"np{n}": setting + [f"train.epochs={epochs}", f"train.steps_per_epoch={steps_per_epoch}",
                             f"train.global_batch_size={n * per_rank_batch}"]
        for n in (1, 2)
    }
    samples = alternate(
        {name: train_job(overrides, launcher=horovod_launcher(int(name[2:]))) for name, overrides in jobs.items()},
        repeats=repeats, warmup=0,
    )
    rate = medians(samples)
    efficiency = rate["np2"] / (2 * rate["np1"])

    steps = 3  # enough to see the per-step pattern; the log is long
    count_job = setting + ["train.epochs=1", f"train.steps_per_epoch={steps}",
                           f"train.global_batch_size={2 * per_rank_batch}"]
    fused = count_gradient_allreduces(count_job + [f"horovod.fusion_threshold_bytes={fusion_threshold_bytes}"], steps)
    unfused = count_gradient_allreduces(count_job + ["horovod.fusion_threshold_bytes=0"], steps)
    gradient_bytes = _gradient_bytes(image_size, width)
    bound = math.ceil(gradient_bytes / fusion_threshold_bytes) + 1
    custom = custom_loops(repeats=repeats, steps=epochs * steps_per_epoch, per_rank_batch=per_rank_batch,
                          image_size=image_size, width=width)
    custom_rate = {name: statistics.median(values) for name, values in custom.items()}
    custom_ratio = custom_rate["tape"] / custom_rate["grouped_allreduce"]
    return {
        "benchmark": "horovod",
        "jobs": described(jobs),
        "per_rank_batch": per_rank_batch,
        "repeats": repeats,
        "samples_per_sec": rate,
        "samples": samples,
        "custom_loop_samples_per_sec": custom_rate,
        "custom_loop_samples": custom,
        "gradient_bytes": gradient_bytes,
        "gradient_tensors": unfused["tensors_per_step"],
        "fusion_threshold_bytes": fusion_threshold_bytes,
        "figures": {
            "scaling_efficiency_np2": efficiency,
            "allreduce_calls_per_step_fused": fused["calls_per_step"],
            "allreduce_calls_per_step_unfused": unfused["calls_per_step"],
            "allreduce_calls_bound": bound,
            "target_efficiency": TARGET_EFFICIENCY,
            "meets_target": efficiency >= TARGET_EFFICIENCY and fused["calls_per_step"] <= bound,
            "custom_loop_ratio": custom_ratio,
            "target_custom_loop_ratio": TARGET_CUSTOM_LOOP_RATIO,
            "custom_loop_meets_target": custom_ratio >= TARGET_CUSTOM_LOOP_RATIO,
        },
    }


def custom_loops(*, repeats: int, steps: int, per_rank_batch: int, image_size: int,
                 width: int) -> dict[str, list[float]]:
    """Samples/sec of each timing of the two custom loops, from one 2-rank job (pinned like the Keras jobs)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "custom_loops.json")
        arguments = [out, repeats, steps, per_rank_batch, image_size, width]
        done = subprocess.run([*horovod_launcher(2), sys.executable, script("horovod_custom_loop.py"),
                               *map(str, arguments)], capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        if done.returncode != 0:
            raise RuntimeError(f"the custom-loop job failed:\n{(done.stdout + done.stderr)[-3000:]}")
        with open(out) as f:
            return json.load(f)


def count_gradient_allreduces(overrides: list[str], steps: int) -> dict[str, float]:
    """All-reduce calls (fused responses) and tensors per step of a 2-rank job of `steps`
    training steps, from rank 0's Horovod trace log."""
    with tempfile.TemporaryDirectory() as scratch:
        done = run_train(overrides, os.path.join(scratch, "metrics.json"),
                         launcher=[HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo"],
                         env={"HOROVOD_LOG_LEVEL": "trace"})
    calls = tensors = 0
    for line in (done.stdout + done.stderr).splitlines():
        match = _RESPONSES.search(line)
        if not line.startswith("[0]") or not match:
            continue
        for response in filter(None, (r.strip() for r in match.group(1).split(";"))):
            if "HorovodGroupedAllreduce_gradient" in response:  # the optimizer's gradients, not metric reads
                calls += 1
                tensors += len(response.split(", "))
    return {"calls_per_step": calls / steps, "tensors_per_step": tensors / steps}


def _gradient_bytes(image_size: int, width: int) -> int:
    """Bytes of the float32 gradients of the benchmark's model (its trainable weights)."""
    from tfdist import models
    from tfdist.config.schema import ModelConfig

    model = models.build(ModelConfig(width=width), input_shape=(image_size, image_size, 1), num_classes=10)
    return 4 * sum(math.prod(w.shape) for w in model.trainable_weights)
