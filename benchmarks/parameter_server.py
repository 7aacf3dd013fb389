"""`tfdist bench parameter_server`: 1 parameter server + 2 workers against all-reduce.

Both sides are `tfdist train` jobs on the same model, data and two cores, each
run as its own process (a chief connects to its cluster for good), in
alternating rounds:

- parameter server: 2 worker processes and 1 parameter server on loopback,
  one intra-op thread per task, each step one batch of `per_device_batch` on
  whichever worker is free;
- all-reduce: MirroredStrategy over 2 logical CPUs in one process, intra-op 1 /
  inter-op 2 threads, global batch 2 x `per_device_batch`.

The same batch per device, as in Horovod's comparison. Figure:
`ps_vs_allreduce` = median samples/sec of the parameter-server job over the
all-reduce job's (target >= 0.8).
"""

from __future__ import annotations

from typing import Any

from tfdist.bench.jobs import described, train_job
from tfdist.timing import alternate, medians

__all__ = ["measure"]

TARGET = 0.8


def measure(*, repeats: int = 5, per_device_batch: int = 64, epochs: int = 3, steps_per_epoch: int = 40,
            width: int = 32, steps_per_execution: int = 4) -> dict[str, Any]:
    common = [
        "train.verbose=0", f"train.epochs={epochs}", f"train.steps_per_epoch={steps_per_epoch}",
        f"model.width={width}", "callbacks.throughput_warmup_steps=10",
    ]
    jobs = {
        "parameter_server": common + [
            "strategy.kind=parameter_server", f"train.global_batch_size={per_device_batch}",
            "parameter_server.num_workers=2", "parameter_server.num_ps=1",
            "parameter_server.threads_per_task=1", f"parameter_server.steps_per_execution={steps_per_execution}",
            "runtime.intra_op_threads=1", "runtime.inter_op_threads=2",
        ],
        "allreduce": common + [
            "strategy.kind=mirrored", "strategy.logical_devices=2",
            f"train.global_batch_size={2 * per_device_batch}",
            "runtime.intra_op_threads=1", "runtime.inter_op_threads=2",
        ],
    }
    samples = alternate({name: train_job(overrides) for name, overrides in jobs.items()}, repeats=repeats, warmup=0)
    rate = medians(samples)
    ratio = rate["parameter_server"] / rate["allreduce"]
    return {
        "benchmark": "parameter_server",
        "jobs": described(jobs),
        "per_device_batch": per_device_batch,
        "epochs": epochs,
        "steps_per_epoch": steps_per_epoch,
        "repeats": repeats,
        "samples_per_sec": rate,
        "samples": samples,
        "figures": {"ps_vs_allreduce": ratio, "target": TARGET, "meets_target": ratio >= TARGET},
    }
