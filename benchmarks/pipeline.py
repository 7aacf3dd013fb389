"""`tfdist bench pipeline`: pipeline schedules against naive model parallelism.

Two stages on two logical CPU devices with single-threaded ops (intra-op 1,
inter-op 2: DESIGN.md shows that such ops run concurrently). The model is a
stack of wide Dense layers cut in half. Naive model parallelism is the same
strategy with one micro-batch (stage 2 waits for stage 1, and back). Each
variant trains with `model.fit`; rounds alternate and medians are compared.

Figures: `speedup_m{M}_{schedule}` = naive step time / pipelined step time,
`bound_m{M}` = K*M/(M+K-1), and `stash_ratio_1f1b_vs_gpipe` = the most
micro-batch activations a stage keeps alive under 1F1B over GPipe at M=8
(counted from the schedule each stage's device is made to follow).
Targets: speedup_m8_1f1b >= 0.95 x bound_m8; stash ratio <= min(M, K)/M.

Logical CPUs share one thread pool, so unlike a GPU a "device" here is not a
serial executor: naive model parallelism already runs a layer's two backward
matmuls (input and kernel gradients) side by side. To show what that and the
smaller micro-batch matmuls cost, a child process with one inter-op thread
times naive and M=8 1F1B serially, giving `naive_overlap` (serial / 2-thread
naive step), `microbatch_cost_m8` (serial M=8 / serial naive) and
`concurrency_m8_1f1b` (serial M=8 / 2-thread M=8, at most 2). The speed-up is
concurrency / (overlap x micro-batch cost); against naive stages that run one
op at a time, as on GPUs, it would be `speedup_m8_1f1b_vs_serial_naive`.

Where the model lives (each stage's variables and optimizer slots on its
device): `max_device_share_params_k{K}` and `max_device_share_optimizer_k{K}`
are the largest share of parameter bytes, and of optimizer bytes, that one
device holds, for tfdist's transformer (4 blocks, width 128, Adam) balanced by
parameters over K=2 and K=4 stages; target at most 1.15/K.
`weight_bytes_copied_per_step` counts the variable bytes the M=8 1F1B training
step sends between devices, read from the partition graphs TensorFlow ran
(`tfdist.parallel.copies`); target 0. The same figure with every variable on
the first device (`place_variables=False`, the placement before) shows what
the move removes, and `step_vs_first_device_m8_1f1b` times both placements in
the same alternated rounds; target at most 1.02.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Optional, Sequence

import numpy as np

from tfdist.bench.jobs import ROOT
from tfdist.callbacks.throughput import fit_round
from tfdist.timing import alternate, medians

__all__ = ["measure", "bound"]

NUM_STAGES = 2
MICRO_BATCHES = (2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")
SERIAL_VARIANTS = ("naive_m1", "m8_1f1b")
SERIAL_TIMEOUT_SECONDS = 1800
MEMORY_STAGES = (2, 4)


def bound(num_stages: int, micro_batches: int) -> float:
    """GPipe's ideal speed-up over naive model parallelism: K*M/(M+K-1)."""
    return num_stages * micro_batches / (micro_batches + num_stages - 1)


def measure(
    *,
    repeats: int = 5,
    width: int = 512,
    layers: int = 8,
    batch: int = 2048,
    steps_per_round: int = 6,
) -> dict[str, Any]:
    """Times every variant with 2 inter-op threads here and the serial reference in a child."""
    size = {"width": width, "layers": layers, "batch": batch, "steps_per_round": steps_per_round}
    serial = _serial_reference(repeats=repeats, **size)
    step_ms, samples, stash, copied = _time_variants(inter_op=2, repeats=repeats, **size)
    held = {k: _memory_held(k) for k in MEMORY_STAGES}
    m_max = MICRO_BATCHES[-1]
    figures: dict[str, Any] = {}
    for m in MICRO_BATCHES:
        figures[f"bound_m{m}"] = bound(NUM_STAGES, m)
        for schedule in SCHEDULES:
            figures[f"speedup_m{m}_{schedule}"] = step_ms["naive_m1"] / step_ms[f"m{m}_{schedule}"]
    figures["stash_ratio_1f1b_vs_gpipe"] = max(stash[f"m{m_max}_1f1b"]) / max(stash[f"m{m_max}_gpipe"])
    figures["efficiency_m8_1f1b"] = figures["speedup_m8_1f1b"] / figures["bound_m8"]
    figures["naive_overlap"] = serial["naive_m1"] / step_ms["naive_m1"]
    figures["microbatch_cost_m8"] = serial["m8_1f1b"] / serial["naive_m1"]
    figures["concurrency_m8_1f1b"] = serial["m8_1f1b"] / step_ms["m8_1f1b"]
    figures["speedup_m8_1f1b_vs_serial_naive"] = serial["naive_m1"] / step_ms["m8_1f1b"]
    figures["meets_speedup_target"] = figures["efficiency_m8_1f1b"] >= 0.95
    figures["meets_stash_target"] = figures["stash_ratio_1f1b_vs_gpipe"] <= min(m_max, NUM_STAGES) / m_max
    for k, by_kind in held.items():
        for kind, by_device in by_kind.items():
            figures[f"max_device_share_{kind}_k{k}"] = max(by_device.values()) / sum(by_device.values())
    figures["meets_memory_target"] = all(
        figures[f"max_device_share_{kind}_k{k}"] <= 1.15 / k for k in MEMORY_STAGES for kind in ("params", "optimizer")
    )
    figures["weight_bytes_copied_per_step"] = copied["m8_1f1b"]
    figures["weight_bytes_copied_per_step_first_device"] = copied["m8_1f1b_first_device"]
    figures["step_vs_first_device_m8_1f1b"] = step_ms["m8_1f1b"] / step_ms["m8_1f1b_first_device"]
    figures["meets_copy_target"] = figures["weight_bytes_copied_per_step"] == 0
    figures["meets_placement_step_target"] = figures["step_vs_first_device_m8_1f1b"] <= 1.02
    return {
        "benchmark": "pipeline",
        "strategy": "pipeline",
        "devices": [f"/cpu:{i}" for i in range(NUM_STAGES)],
        "num_stages": NUM_STAGES,
        "global_batch_size": batch,
        "model": {"layers": layers, "width": width},
        "threads": {"intra_op": 1, "inter_op": 2, "serial_reference_inter_op": 1},
        "steps_per_round": steps_per_round,
        "repeats": repeats,
        "step_time_ms": step_ms,
        "serial_step_time_ms": serial,
        "samples_per_sec": {k: 1000 * batch / v for k, v in step_ms.items()},
        "peak_stashed_micro_batches": stash,
        "bytes_by_device": {f"k{k}": by_kind for k, by_kind in held.items()},
        "samples": samples,
        "figures": figures,
    }


def _serial_reference(**size) -> dict[str, float]:
    """Median step times of SERIAL_VARIANTS with one inter-op thread, in a fresh process
    (thread pools are fixed once TensorFlow starts)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, "-m", "benchmarks.pipeline", json.dumps(size)]  # from the checkout's root
    try:
        done = subprocess.run(
            command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=SERIAL_TIMEOUT_SECONDS, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"the serial reference run took over {SERIAL_TIMEOUT_SECONDS} s") from error
    if done.returncode != 0:
        raise RuntimeError(f"the serial reference run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _time_variants(
    *,
    inter_op: int,
    repeats: int,
    width: int,
    layers: int,
    batch: int,
    steps_per_round: int,
    only: Optional[Sequence[str]] = None,
):
    """Builds and times the variants in this process; returns medians, samples, stash counts and,
    per variant measured for it, the variable bytes one training step copies between devices."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)

    import keras

    from tfdist.parallel.copies import variable_copies, weight_bytes
    from tfdist.strategies.devices import ensure_logical_cpus
    from tfdist.strategies.pipeline import PipelineStrategy

    ensure_logical_cpus(max(MEMORY_STAGES))
    devices = [f"/cpu:{i}" for i in range(NUM_STAGES)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width)).astype("float32")
    y = rng.standard_normal((batch, width)).astype("float32")
    # One batch repeated: no input work competes with the stages for the two cores.
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    names = [f"dense{i}" for i in range(layers)]

    def build(micro_batches: int, schedule: str, place_variables: bool = True):
        strategy = PipelineStrategy(
            NUM_STAGES,
            micro_batches,
            schedule=schedule,
            devices=devices,
            boundaries=[names[layers // 2]],
            verbose=False,
            place_variables=place_variables,
        )
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [keras.Input((width,))]
                + [keras.layers.Dense(width, activation="relu", name=n) for n in names]
            )
            model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        return strategy, model

    plan = {"naive_m1": (1, "gpipe")}
    plan.update({f"m{m}_{s}": (m, s) for m in MICRO_BATCHES for s in SCHEDULES})
    plan["m8_1f1b_first_device"] = (8, "1f1b", False)
    variants = {name: build(*args) for name, args in plan.items() if only is None or name in only}

    # The first step builds the step function: read what it copies between devices then.
    copied = {
        name: weight_bytes(variable_copies(lambda: model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)))
        for name, (_, model) in variants.items()
        if name.startswith("m8_1f1b")
    }
    rounds = {
        name: fit_round(model, dataset, batch=batch, steps=steps_per_round) for name, (_, model) in variants.items()
    }
    samples = alternate(rounds, repeats=repeats)
    stash = {name: strategy.peak_stashed_micro_batches for name, (strategy, _) in variants.items()}
    return medians(samples), samples, stash, copied


def _memory_held(num_stages: int) -> dict[str, dict[str, int]]:
    """Parameter and optimizer bytes per device after one Adam step of tfdist's transformer,
    balanced by parameters over `num_stages` stages."""
    import keras

    from tfdist import models
    from tfdist.config.schema import ModelConfig, ModelName
    from tfdist.strategies.pipeline import PipelineStrategy
    from tfdist.strategies.replica_groups import bytes_by_device

    strategy = PipelineStrategy(
        num_stages, 4, devices=[f"/cpu:{i}" for i in range(num_stages)], balance_by="params", verbose=False
    )
    with strategy.scope():
        keras.utils.set_random_seed(0)
        config = ModelConfig(name=ModelName.TRANSFORMER.value, width=128, depth=4, heads=4)
        model = models.build(config, input_shape=(8, 8, 1), num_classes=10)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).random((32, 8, 8, 1), dtype="float32")
    model.fit(x, np.zeros(32, "int32"), batch_size=32, epochs=1, verbose=0)
    return {"params": bytes_by_device(model.weights), "optimizer": bytes_by_device(model.optimizer.variables)}


if __name__ == "__main__":  # the serial reference child: prints its medians as JSON
    _size = json.loads(sys.argv[1])
    _medians, *_ = _time_variants(inter_op=1, repeats=_size.pop("repeats"), only=SERIAL_VARIANTS, **_size)
    print(json.dumps(_medians))
