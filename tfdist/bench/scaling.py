"""`tfdist bench scaling --config F --json out.json --plot out.png`: speed-up against devices.

Trains the config's model for a fixed number of steps on 1, 2, 4, ... devices
and reports the table and the plot a team puts in its report (Krizhevsky et
al.: 1.7x with 2 GPUs, 3.5x with 4). Weak scaling, as Horovod and
tf_cnn_benchmarks measure: every device gets the config's
`train.global_batch_size`, so N devices train N times that per step.

Backends, each run as whole `tfdist train` jobs in fresh processes:

- `mirrored`: strategy.kind=mirrored over N devices (every GPU up to N, else N
  logical CPU devices; logical CPUs share one thread pool, so on a machine
  without GPUs this shows the all-reduce's cost, not a speed-up);
- `horovod`: strategy.kind=horovod under `horovodrun -np N`, each rank pinned
  to its own core, where Horovod is installed and N <= the cores.

`speedup` = samples/sec(N) / samples/sec(1) of the same backend;
`efficiency` = speedup / N. Rounds alternate over N; medians are kept.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import yaml

from tfdist.bench.jobs import horovod_available, horovod_launcher, train_job
from tfdist.bench.plots import png
from tfdist.timing import alternate, medians
from tfdist.config.loading import to_dict
from tfdist.config.schema import Config
from tfdist.errors import ConfigError

__all__ = ["device_counts", "markdown_table", "measure", "plot", "run"]


def run(*, config: Optional[Config] = None, repeats: int = 3, plot_path: Optional[str] = None) -> dict[str, Any]:
    if config is None:
        raise ConfigError("config", "is needed by the scaling benchmark: --config F names the model and batch.", None)
    result = measure(config, repeats=repeats)
    if plot_path:
        plot(result, plot_path)
        result["plot"] = plot_path
    return result


def device_counts(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit` (and `limit` itself)."""
    counts, n = [], 1
    while n < limit:
        counts.append(n)
        n *= 2
    return counts + [limit]


def measure(config: Config, *, repeats: int = 3, max_devices: Optional[int] = None, epochs: int = 2,
            steps_per_epoch: int = 15) -> dict[str, Any]:
    """Samples/sec of the config's job on 1, 2, 4, ... devices, per backend."""
    from tfdist.strategies.devices import physical_gpus

    gpus = physical_gpus()
    limit = max_devices or gpus or config.strategy.logical_devices
    batch = config.train.global_batch_size
    base = [
        "train.verbose=0", f"train.epochs={epochs}", f"train.steps_per_epoch={steps_per_epoch}",
        f"callbacks.throughput_warmup_steps={min(5, steps_per_epoch - 1)}",
    ]
    backends = {"mirrored": {n: ["strategy.kind=mirrored", f"strategy.logical_devices={n}", "strategy.devices=[]"]
                             for n in device_counts(limit)}}
    cores = len(os.sched_getaffinity(0))
    if horovod_available():
        backends["horovod"] = {n: ["strategy.kind=horovod", "strategy.devices=[]", "runtime.intra_op_threads=1"]
                               for n in device_counts(min(limit, cores))}
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "config.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(to_dict(config), f)
        rounds = {
            f"{backend}/{n}": train_job(
                [*overrides, *base, f"train.global_batch_size={n * batch}"], config=path,
                launcher=horovod_launcher(n) if backend == "horovod" else (),
            )
            for backend, jobs in backends.items() for n, overrides in jobs.items()
        }
        samples = alternate(rounds, repeats=repeats, warmup=0)
    per_sec = medians(samples)
    table = {
        backend: [
            {"devices": n, "samples_per_sec": per_sec[f"{backend}/{n}"],
             "speedup": per_sec[f"{backend}/{n}"] / per_sec[f"{backend}/1"],
             "efficiency": per_sec[f"{backend}/{n}"] / (n * per_sec[f"{backend}/1"])}
            for n in jobs
        ]
        for backend, jobs in backends.items()
    }
    largest = {backend: rows[-1] for backend, rows in table.items()}
    return {
        "benchmark": "scaling",
        "model": config.model.name,
        "batch_per_device": batch,
        "gpus": gpus,
        "steps": epochs * steps_per_epoch,
        "repeats": repeats,
        "table": table,
        "samples": samples,
        "figures": {
            f"{backend}_speedup_at_{row['devices']}": row["speedup"] for backend, row in largest.items()
        } | {f"{backend}_efficiency_at_{row['devices']}": row["efficiency"] for backend, row in largest.items()},
    }


def markdown_table(result: dict[str, Any]) -> str:
    """The table as Markdown rows (for docs/figures.md)."""
    lines = ["| backend | devices | samples/sec | speed-up | efficiency |", "| --- | --- | --- | --- | --- |"]
    for backend, rows in result["table"].items():
        for row in rows:
            lines.append(f"| {backend} | {row['devices']} | {row['samples_per_sec']:.0f} | "
                         f"{row['speedup']:.2f} | {row['efficiency']:.2f} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str):
    """Speed-up against devices, one line per backend and the ideal line; saved as PNG. Returns the figure."""
    with png(path) as (figure, axes):
        most = max(row["devices"] for rows in result["table"].values() for row in rows)
        axes.plot([1, most], [1, most], linestyle="--", color="gray", label="ideal (speed-up = devices)")
        for backend, rows in result["table"].items():
            axes.plot([r["devices"] for r in rows], [r["speedup"] for r in rows], marker="o", label=backend)
        axes.set_xlabel("devices")
        axes.set_ylabel("speed-up over 1 device (samples/sec)")
        axes.set_title(f"tfdist scaling: {result['model']}, {result['batch_per_device']} per device")
        axes.set_xticks(sorted({row["devices"] for rows in result["table"].values() for row in rows}))
    return figure
