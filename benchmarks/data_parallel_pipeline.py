"""`tfdist bench data_parallel_pipeline`: scaling of a pipeline job from 1 process to 2.

`tfdist train` pipeline jobs (2 stages on 2 logical CPUs per process, 1F1B,
4 micro-batches) with `strategy.data_parallel=horovod` under `horovodrun -np
1` and `-np 2`, alternated, each process pinned to its own core with one
intra-op thread and the same batch per process (weak scaling), on a
compute-bound convolutional model (synthetic images). Figure:
`scaling_efficiency_np2` = samples/sec(np 2) / (2 x samples/sec(np 1)), that
is samples/sec per process of the 2-process job over the 1-process job's.
"""

from __future__ import annotations

from typing import Any

from tfdist.bench.jobs import described, horovod_launcher, train_job
from tfdist.timing import alternate, medians

__all__ = ["measure"]


def measure(*, repeats: int = 5, per_process_batch: int = 128, image_size: int = 16, width: int = 32,
            epochs: int = 2, steps_per_epoch: int = 20) -> dict[str, Any]:
    setting = [
        "strategy.kind=pipeline", "strategy.data_parallel=horovod", "strategy.logical_devices=2",
        "pipeline.num_stages=2", "pipeline.num_micro_batches=4", "pipeline.balance_by=params",
        "train.verbose=0", "data.dataset=synthetic", f"data.image_size={image_size}",
        "data.synthetic_examples=4096", "model.name=digits_cnn", f"model.width={width}",
        "runtime.intra_op_threads=1", "runtime.inter_op_threads=2", "callbacks.throughput_warmup_steps=10",
        f"train.epochs={epochs}", f"train.steps_per_epoch={steps_per_epoch}",
    ]
    jobs = {f"np{n}": setting + [f"train.global_batch_size={n * per_process_batch}"] for n in (1, 2)}
    samples = alternate(
        {name: train_job(overrides, launcher=horovod_launcher(int(name[2:]))) for name, overrides in jobs.items()},
        repeats=repeats, warmup=0,
    )
    rate = medians(samples)
    return {
        "benchmark": "data_parallel_pipeline",
        "jobs": described(jobs),
        "per_process_batch": per_process_batch,
        "repeats": repeats,
        "samples_per_sec": rate,
        "samples": samples,
        "figures": {
            "scaling_efficiency_np2": rate["np2"] / (2 * rate["np1"]),
            "samples_per_sec_per_process_np1": rate["np1"],
            "samples_per_sec_per_process_np2": rate["np2"] / 2,
        },
    }
