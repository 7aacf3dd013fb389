"""`tfdist plan`: which layout of a job fits the devices, and how fast each would run, before a run.

    tfdist plan --config my.yaml --devices 8 --device_memory 80GiB --device_tflops 100 --intra_link 600GB/s
    tfdist plan --config my.yaml --cluster 2x8-a100-80g-ib --out plan.yaml --json plan.json
    tfdist plan --config configs/pipeline.yaml --devices 2 --measure     # this machine's own speed
    tfdist plan --config my.yaml --devices 8 --device_memory 80GiB       # memory alone: which layouts fit

The config's model is built once on the CPU (`profile`), every layout the
devices allow is predicted (`predict`), and the table is printed fastest
first; the fastest that fits is written as a config (`--out`) that `tfdist
train`, `launch`, `slurm` and `k8s` take as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tfdist.plan.cluster import PRESETS, Cluster, format_bytes, from_preset, parse_bytes, parse_duration, parse_rate
from tfdist.plan.measure import MeasuredTimes, one_device_config, shared_cores
from tfdist.plan.predict import Layout, Prediction, layouts, predict, recommended
from tfdist.plan.profile import ModelProfile, profile

__all__ = ["PRESETS", "SPEED_FLAGS", "Cluster", "Layout", "MeasuredTimes", "ModelProfile", "Prediction",
           "from_preset", "layout_overrides", "make_plan", "one_device_config", "parse_bytes", "parse_duration",
           "parse_rate", "profile", "shared_cores", "table"]

SPEED_FLAGS = "--device_tflops, a --cluster preset or --measure"


def make_plan(config, cluster: Cluster, model: Optional[ModelProfile] = None,
              measured: Optional[MeasuredTimes] = None) -> dict[str, Any]:
    """Every layout's prediction for `config`'s job on `cluster`, fastest first, and the recommended one.
    Without the devices' speed (`cluster.device_flops` 0) only memory is predicted: the layouts that fit
    come first, in `layouts`' order, no step time is given and none is recommended. With `measured`
    (`--measure`), a pipeline's stages are timed on this machine."""
    model = model or profile(config)
    batch = config.train.global_batch_size
    pipeline = config.pipeline
    predictions = [predict(model, cluster, layout, global_batch=batch, micro_batches=pipeline.num_micro_batches,
                           schedule=pipeline.schedule.value, recompute=pipeline.recompute,
                           balance_by=pipeline.balance_by.value, measured=measured)
                   for layout in layouts(model, cluster, global_batch=batch, model_axis=_model_axis(config))]
    if not cluster.device_flops:  # a step time of communication alone would rank the layouts wrongly
        predictions = [dataclasses.replace(p, step_ms={}, samples_per_sec=0.0, scaling_efficiency=0.0)
                       for p in predictions]
    predictions.sort(key=lambda p: (not p.fits, -p.samples_per_sec))
    best = recommended(predictions)
    return {"model": model.to_dict(), "cluster": vars(cluster), "global_batch_size": batch,
            **({"measured": measured.to_dict()} if measured else {}),
            "layouts": [p.to_dict() for p in predictions],
            "recommended": best.to_dict() if best else None,
            "recommended_overrides": layout_overrides(best.layout, cluster, batch) if best else []}


def _model_axis(config) -> int:
    """A layout config's model axis, which its plan keeps (0: the planner chooses how to split)."""
    return config.layout.model_devices if config.strategy.kind == "layout" else 0


def layout_overrides(layout: Layout, cluster: Cluster, global_batch: int) -> list[str]:
    """The `--set` overrides that make a config train with `layout` on `cluster`'s devices."""
    across = cluster.hosts > 1
    if layout.parameter_server:  # a parameter-server job's batch is one worker's
        return ["strategy.kind=parameter_server", f"parameter_server.num_workers={layout.dp}",
                f"parameter_server.num_ps={cluster.hosts}", f"train.global_batch_size={global_batch // layout.dp}"]
    if layout.mesh:  # the config's own layout: its mesh over a host's devices, data parallel across hosts
        return [f"strategy.logical_devices={cluster.per_host}",
                f"layout.data_devices={cluster.per_host // layout.tensor_parallel}",
                f"strategy.data_parallel={'multi_worker' if across else 'local'}"]
    overrides = [f"strategy.logical_devices={cluster.per_host}", f"strategy.shard_optimizer={layout.zero}",
                 f"train.remat={'full' if layout.remat else 'none'}"]
    if layout.stages > 1:
        overrides += ["strategy.kind=pipeline", f"pipeline.num_stages={layout.stages}",
                      f"strategy.data_parallel={'multi_worker' if across else 'local'}"]
        if layout.tensor_parallel > 1:
            overrides.append(f"strategy.tensor_parallel_size={layout.tensor_parallel}")
    elif layout.tensor_parallel > 1:
        overrides += ["strategy.kind=tensor_parallel", f"strategy.tensor_parallel_size={layout.tensor_parallel}",
                      f"strategy.data_parallel={'multi_worker' if across else 'local'}"]
    else:
        overrides.append(f"strategy.kind={'multi_worker_mirrored' if across else 'mirrored'}")
    return overrides


def table(result: dict[str, Any]) -> str:
    """The plan as the text `tfdist plan` prints: one row per layout, fastest first."""
    cluster = result["cluster"]
    lines = [f"{cluster['devices']} devices on {cluster['hosts']} host(s), {result['model']['name']}, "
             f"global batch {result['global_batch_size']} ({cluster['source']})",
             f"{'':<40} {'memory on the fullest device':^49}",
             f"{'layout':<40} {'total':>9} {'weights':>9} {'grads':>9} {'optimizer':>9} {'activ.':>9} "
             f"{'step ms':>9} {'samples/s':>10} {'scaling':>8}  note"]
    for row in result["layouts"]:
        memory, step = row["memory_bytes"], row["step_ms"]
        sizes = [format_bytes(memory[key]) if memory else "-"
                 for key in ("total", "weights", "gradients", "optimizer", "activations")]
        speed = f"{row['samples_per_sec']:.4g}" if row["samples_per_sec"] else "-"
        total = f"{step['total']:.4g}" if step else "-"
        scaling = f"{row['scaling_efficiency']:.1%}" if row["scaling_efficiency"] else "-"
        lines.append(f"{row['layout']:<40} {sizes[0]:>9} {sizes[1]:>9} {sizes[2]:>9} {sizes[3]:>9} {sizes[4]:>9} "
                     f"{total:>9} {speed:>10} {scaling:>8}  {row['note']}")
    best, rows = result["recommended"], result["layouts"]
    if best:
        lines.append(f"recommended: {best['layout']} "
                     f"({' '.join('--set ' + o for o in result['recommended_overrides'])})")
    elif not cluster["device_flops"]:
        lines.append(f"recommended: none without the devices' speed ({SPEED_FLAGS}); "
                     f"{sum(row['fits'] for row in rows)} of {len(rows)} layouts fit")
    else:
        lines.append("recommended: none fits")
    return "\n".join(lines)
