"""`tfdist bench precision`: does mixed_bfloat16 keep its speed-up under every strategy?

For each kind, `tfdist train` jobs with `precision.policy` float32 and
mixed_bfloat16 alternate (each a whole job in fresh processes, 8 warm-up then
`steps` timed steps, wall-clock samples/sec). The model is the built-in
transformer (Dense layers do most of its work; tensor parallelism needs it) on
synthetic 32x32 images read as 32 tokens, intra-op 1 and inter-op 2 threads,
global batch 64:

- `one_device`: one CPU device (the reference);
- `mirrored`: 2 logical devices;
- `pipeline`: 2 stages on 2 logical devices, 4 micro-batches;
- `tensor_parallel`: 2 logical devices;
- `horovod`: 2 ranks under horovodrun, each pinned to its own core.

Figures: `KIND_speedup` = samples/sec(mixed_bfloat16) / samples/sec(float32)
(medians), and `KIND_vs_one_device` = that speed-up / one device's. Target:
>= 0.9 of one device's where the CPU has AMX-BF16 (`amx_bf16` in
/proc/cpuinfo), the hardware whose bfloat16 matmuls make the speed-up; on other
CPUs the figures are reported and the target is marked not applicable.
"""

from __future__ import annotations

from typing import Any, Sequence

from tfdist.bench import machine
from tfdist.bench.jobs import described, horovod_launcher, train_job
from tfdist.timing import alternate, medians

__all__ = ["KINDS", "measure"]

TARGET = 0.9
POLICIES = ("float32", "mixed_bfloat16")
KINDS = {
    "one_device": ["strategy.kind=one_device"],
    "mirrored": ["strategy.kind=mirrored", "strategy.logical_devices=2"],
    "pipeline": ["strategy.kind=pipeline", "strategy.logical_devices=2", "pipeline.num_stages=2",
                 "pipeline.num_micro_batches=4"],
    "tensor_parallel": ["strategy.kind=tensor_parallel", "strategy.logical_devices=2"],
    "horovod": ["strategy.kind=horovod"],
}


def measure(*, repeats: int = 5, kinds: Sequence[str] = tuple(KINDS), width: int = 256, image_size: int = 32,
            warmup: int = 8, steps: int = 40) -> dict[str, Any]:
    unknown = set(kinds) - set(KINDS)
    if unknown or "one_device" not in kinds:
        raise ValueError(f"`kinds` must be among {tuple(KINDS)} and include one_device. Received: {list(kinds)}")
    common = ["train.verbose=0", "train.epochs=1", f"train.steps_per_epoch={warmup + steps}",
              f"callbacks.throughput_warmup_steps={warmup}", "train.global_batch_size=64",
              "data.dataset=synthetic", f"data.image_size={image_size}", "data.synthetic_examples=2048",
              "model.name=transformer", f"model.width={width}", "model.depth=2", "model.heads=4",
              "runtime.intra_op_threads=1", "runtime.inter_op_threads=2"]
    results: dict[str, Any] = {}
    speedup: dict[str, float] = {}
    for kind in kinds:
        jobs = {policy: [*common, *KINDS[kind], f"precision.policy={policy}"] for policy in POLICIES}
        launcher = horovod_launcher(2) if kind == "horovod" else ()
        samples = alternate({policy: train_job(overrides, launcher=launcher) for policy, overrides in jobs.items()},
                            repeats=repeats, warmup=0)
        rate = medians(samples)
        speedup[kind] = rate["mixed_bfloat16"] / rate["float32"]
        results[kind] = {"samples_per_sec": rate, "samples": samples, "jobs": described(jobs)}
    applicable = "amx_bf16" in machine.describe()["cpu_flags"]
    figures: dict[str, Any] = {f"{kind}_speedup": speedup[kind] for kind in kinds}
    relative = {kind: speedup[kind] / speedup["one_device"] for kind in kinds if kind != "one_device"}
    figures.update({f"{kind}_vs_one_device": value for kind, value in relative.items()})
    figures.update({"target": TARGET, "target_applies": applicable,
                    "meets_target": all(v >= TARGET for v in relative.values()) if applicable else None})
    return {"benchmark": "precision", "repeats": repeats, "timed_steps": steps, "warmup_steps": warmup,
            "kinds": results, "figures": figures}
