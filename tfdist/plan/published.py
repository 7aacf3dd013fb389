"""The planner against published scaling runs: given only the hardware each paper states, how far its
predicted scaling efficiency is from the one the paper measured.

Each run is a keras.applications model on ImageNet-sized synthetic inputs
(1000 classes), trained data parallel with a fixed batch per GPU, and a
cluster preset holding the paper's machines (`tfdist.plan.cluster.PRESETS`):
the GPUs' datasheet rate derated as every preset is, and the stated links.
The efficiency is the one the paper reports: samples/sec on all the GPUs
over their count times the baseline's per GPU (one GPU for Horovod's, one
8-GPU server for Goyal et al.'s).

Where a prediction misses, `compare` says by how much each term would have
to change to meet the published figure: the compute a step (the devices'
rate), or the communication the step waits for (the all-reduce, less
whatever of it overlaps the backward pass on GPUs, which the planner does
not model). Horovod's benchmark at two scales, 128 GPUs and 512, tells the
terms apart: a GPU's compute is the same at both, and so nearly are the
bytes a flat ring sends over each host's link (2(N - 1)/N of the
gradients), so what changes between them is a cost that grows with the
number of GPUs, which the planner does not count.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

__all__ = ["RUNS", "PublishedRun", "compare"]

BOUND_POINTS = 10  # the issue's: the predicted efficiency within 10 points of the published one


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str  # keras.applications
    image_size: int
    batch_per_gpu: int
    cluster: str  # a preset of tfdist.plan.cluster
    baseline_hosts: int  # 0: one GPU; else that many whole hosts
    efficiency: float  # as published
    source: str
    hosts: int = 0  # 0: the preset's


_HOROVOD = ("Horovod's README and docs/benchmarks.rst (128 servers of 4 Pascal GPUs, RoCE 25 Gbit/s, "
            "tf_cnn_benchmarks at --batch_size 64); Sergeev and Del Balso, arXiv:1802.05799")
# The same benchmark on 32 of those servers, as Horovod's README and docs/benchmarks.md stated it from October
# 2017 until the 512-GPU chart replaced it in May 2018.
_HOROVOD_128 = ("Horovod's README and docs/benchmarks.md before May 2018 (32 servers of 4 Pascal GPUs, RoCE 25 "
                "Gbit/s; horovod/horovod at ed0040fe)")
RUNS = (
    PublishedRun("Horovod, Inception V3, 512 GPUs", "InceptionV3", 299, 64, "128x4-p100-25g-roce", 0, 0.90, _HOROVOD),
    PublishedRun("Horovod, ResNet-101, 512 GPUs", "ResNet101", 224, 64, "128x4-p100-25g-roce", 0, 0.90, _HOROVOD),
    PublishedRun("Horovod, VGG-16, 512 GPUs", "VGG16", 224, 64, "128x4-p100-25g-roce", 0, 0.68, _HOROVOD),
    PublishedRun("Horovod, Inception V3, 128 GPUs", "InceptionV3", 299, 64, "128x4-p100-25g-roce", 0, 0.90,
                 _HOROVOD_128, hosts=32),
    PublishedRun("Horovod, ResNet-101, 128 GPUs", "ResNet101", 224, 64, "128x4-p100-25g-roce", 0, 0.90,
                 _HOROVOD_128, hosts=32),
    PublishedRun("Horovod, VGG-16, 128 GPUs", "VGG16", 224, 64, "128x4-p100-25g-roce", 0, 0.79, _HOROVOD_128,
                 hosts=32),
    PublishedRun("Goyal et al., ResNet-50, 256 GPUs against 8", "ResNet50", 224, 32, "32x8-p100-50g", 1, 0.90,
                 "Goyal et al., Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour, arXiv:1706.02677 "
                 "(~90% scaling efficiency from 8 to 256 GPUs, 32 images a GPU)"),
)


def compare(run: PublishedRun) -> dict[str, Any]:
    """The planner's data-parallel prediction for `run`'s cluster and for its baseline, side by side with
    the published efficiency, and what each term would need to be to meet it."""
    from tfdist.plan import Layout, from_preset
    from tfdist.plan.predict import predict
    from tfdist.plan.profile import TRAINING_FLOPS_PER_FORWARD

    model = _profile(run.model, run.image_size)
    cluster = from_preset(run.cluster, run.hosts or None, "float32")
    base = from_preset(run.cluster, run.baseline_hosts, "float32") if run.baseline_hosts else \
        dataclasses.replace(cluster, devices=1, hosts=1)

    def data_parallel(machines):
        return predict(model, machines, Layout(machines.devices), global_batch=run.batch_per_gpu * machines.devices,
                       micro_batches=1)

    scaled, baseline = data_parallel(cluster), data_parallel(base)
    efficiency = scaled.scaling_efficiency / baseline.scaling_efficiency
    # The step time that would give the published efficiency, and each term alone moved to reach it.
    needed_ms = baseline.step_ms["total"] / run.efficiency
    compute, comm = scaled.step_ms["compute"], scaled.step_ms["data_parallel"]
    return {
        "run": run.name, "key": f"{run.model}_{cluster.devices}", "source": run.source, "cluster": cluster.source,
        "model": run.model,
        "inputs": {"gpus": cluster.devices, "gpus_per_host": cluster.per_host, "batch_per_gpu": run.batch_per_gpu,
                   "baseline_gpus": base.devices, "device_tflops": cluster.device_flops / 1e12,
                   "link_gbit": cluster.link / 1e9, "intra_link_gb_per_s": cluster.intra_link / 1e9,
                   "gradient_mb": model.trainable_bytes / 1e6,
                   "training_gflops_per_image": model.training_flops_per_example / 1e9},
        "published": run.efficiency, "predicted": efficiency, "miss_points": 100 * (efficiency - run.efficiency),
        "within_bound": abs(efficiency - run.efficiency) * 100 <= BOUND_POINTS,
        "step_ms": scaled.step_ms, "baseline_step_ms": baseline.step_ms,
        # The predicted backward pass (a step's compute less its forward), for papers that state theirs.
        "backward_ms": compute * (TRAINING_FLOPS_PER_FORWARD - 1) / TRAINING_FLOPS_PER_FORWARD,
        "to_meet_published": {"comm_ms": needed_ms - compute,
                              "compute_ms": _compute_needed(run.efficiency, baseline.step_ms, compute, comm)},
    }


@functools.lru_cache(maxsize=None)  # a model is compared at more than one scale
def _profile(model: str, image_size: int):
    from tfdist.config import load_config
    from tfdist.plan import profile

    config = load_config(None, [f"model.name=keras.applications.{model}", "data.dataset=synthetic",
                                f"data.image_size={image_size}", "data.channels=3", "data.num_classes=1000",
                                "data.synthetic_examples=8", "train.optimizer=sgd"])
    return profile(config, activations=False)  # only its speed is compared


def _compute_needed(published: float, baseline: dict, compute: float, comm: float) -> float:
    """The compute a step that, with the predicted communication at scale and at the baseline, would
    give the published efficiency: (c + base_comm) / (c + comm) = published, solved for c."""
    base_comm = baseline["total"] - baseline["compute"]
    # c + base_comm = published x (c + comm)  =>  c (1 - published) = published x comm - base_comm
    return (published * comm - base_comm) / (1 - published) if published < 1 else float("inf")
