"""`tfdist bench synthetic --model keras.applications.NAME`: images/sec of one model under every strategy kind.

The standard image benchmark (Horovod's `tensorflow2_synthetic_benchmark.py`,
tf_cnn_benchmarks): a model trained with SGD on random images and labels
(`data.dataset: synthetic`, 3 channels, 1000 classes), the same batch per device
everywhere (weak scaling), each job a whole `tfdist train` run in fresh processes:

- `one_device`: strategy.kind=one_device, the baseline;
- `mirrored_2`, `mirrored_4`: MirroredStrategy over 2 and 4 devices (GPUs, or
  logical CPUs, which share one thread pool: on a CPU machine these show the
  all-reduce's cost, not a speed-up);
- `horovod_2`: 2 Horovod ranks under `horovodrun`, each pinned to its own core;
- `multi_worker_2`: MultiWorkerMirroredStrategy over 2 tasks (`tfdist launch`);
- `parameter_server`: 1 parameter server and 2 workers, each step one batch
  on whichever worker is free.

Every process runs one intra-op thread, and the one-device job is pinned to one
core (one core per device; the 2-device jobs get the machine's 2). Rounds alternate
over the jobs; medians are kept. `images_per_sec` is the job's total;
`per_device` divides it by its devices; `speedup` is over `one_device`;
`efficiency` = speedup / devices.

The parameter-server row is the chief's step rate, which counts steps when they
are scheduled, not when they finish (issue: throughput as wall-clock work), so
it overstates that row until the throughput measurement is fixed.
"""

from __future__ import annotations

from typing import Any, Optional

from tfdist.bench.jobs import described, horovod_available, horovod_launcher, on_core, train_job
from tfdist.bench.scaling import plot as scaling_plot
from tfdist.timing import alternate, medians
from tfdist.config.schema import Config
from tfdist.config.sources import model_source
from tfdist.errors import ConfigError

__all__ = ["jobs", "markdown_table", "measure", "run"]

# One device is one core, as each Horovod rank is; unpinned, its inter-op threads would run
# independent ops on a second core.
ONE_CORE = on_core(0)

# What Horovod's docs ("Benchmarks") publish for this benchmark on GPUs, for comparison.
PUBLISHED = ("Horovod, tf_cnn_benchmarks on synthetic data, 128 servers x 4 Pascal GPUs over 25 Gbit/s RoCE: "
             "90% scaling efficiency for Inception V3 and ResNet-101, 68% for VGG-16")


def run(*, config: Optional[Config] = None, repeats: int = 3, plot_path: Optional[str] = None,
        model: Optional[str] = None, image_size: int = 64, batch_per_device: int = 32) -> dict[str, Any]:
    if config is not None:
        raise ConfigError("config", "is not used by the synthetic benchmark: it sets its jobs itself "
                                    "(--model, --image_size, --batch_per_device).", "given")
    if not model:
        raise ConfigError("model", "is needed by the synthetic benchmark, e.g. --model keras.applications.MobileNetV2.",
                          None)
    model_source(model, "model")  # a name tfdist train takes, or one line now rather than six failed jobs
    result = measure(model=model, image_size=image_size, batch_per_device=batch_per_device, repeats=repeats)
    if plot_path:
        plot(result, plot_path)
        result["plot"] = plot_path
    return result


def jobs(*, model: str, image_size: int, batch_per_device: int, steps: int,
         synthetic_examples: int) -> dict[str, dict[str, Any]]:
    """Each job: its devices, `tfdist` command, launcher and `--set` overrides."""
    common = [
        f"model.name={model}", "data.dataset=synthetic", f"data.image_size={image_size}", "data.channels=3",
        "data.num_classes=1000", f"data.synthetic_examples={synthetic_examples}", "data.validation_fraction=0.125",
        "train.optimizer=sgd", "train.learning_rate=0.01", "train.verbose=0", "train.epochs=1",
        f"train.steps_per_epoch={steps}", f"callbacks.throughput_warmup_steps={min(5, steps - 1)}",
        "runtime.intra_op_threads=1", "runtime.inter_op_threads=2",
    ]
    b = batch_per_device
    table = {
        "one_device": (1, ("train",), ONE_CORE, ["strategy.kind=one_device", f"train.global_batch_size={b}"]),
        "mirrored_2": (2, ("train",), (), ["strategy.kind=mirrored", "strategy.logical_devices=2",
                                           f"train.global_batch_size={2 * b}"]),
        "mirrored_4": (4, ("train",), (), ["strategy.kind=mirrored", "strategy.logical_devices=4",
                                           f"train.global_batch_size={4 * b}"]),
        "horovod_2": (2, ("train",), "horovod", ["strategy.kind=horovod", f"train.global_batch_size={2 * b}"]),
        "multi_worker_2": (2, ("launch", "--workers", "2"), (),
                           ["strategy.kind=multi_worker_mirrored", f"train.global_batch_size={2 * b}"]),
        "parameter_server": (2, ("train",), (), [
            "strategy.kind=parameter_server", "parameter_server.num_workers=2", "parameter_server.num_ps=1",
            "parameter_server.threads_per_task=1", f"train.global_batch_size={b}"]),
    }
    out = {}
    for name, (devices, command, launcher, overrides) in table.items():
        if launcher == "horovod":
            if not horovod_available():
                continue  # reported as missing, not measured
            launcher = horovod_launcher(2)
        out[name] = {"devices": devices, "command": command, "launcher": list(launcher),
                     "overrides": common + overrides}
    return out


def measure(*, model: str, image_size: int = 64, batch_per_device: int = 32, repeats: int = 3,
            steps: int = 20) -> dict[str, Any]:
    planned = jobs(model=model, image_size=image_size, batch_per_device=batch_per_device, steps=steps,
                   synthetic_examples=32 * batch_per_device)  # validation: 4 batches of every job's devices
    rounds = {name: train_job(job["overrides"], launcher=job["launcher"], command=job["command"])
              for name, job in planned.items()}
    samples = alternate(rounds, repeats=repeats, warmup=0)
    rate = medians(samples)
    base = rate["one_device"]
    table = [
        {"job": name, "devices": job["devices"], "images_per_sec": rate[name],
         "images_per_sec_per_device": rate[name] / job["devices"], "speedup": rate[name] / base,
         "efficiency": rate[name] / (job["devices"] * base)}
        for name, job in planned.items()
    ]
    return {
        "benchmark": "synthetic",
        "model": model,
        "image_size": image_size,
        "batch_per_device": batch_per_device,
        "steps": steps,
        "repeats": repeats,
        "jobs": described({name: job["overrides"] for name, job in planned.items()}),
        "missing": [] if "horovod_2" in planned else ["horovod_2 (Horovod is not installed)"],
        "table": table,
        "samples": samples,
        "published": PUBLISHED,
        "figures": {f"{row['job']}_images_per_sec": row["images_per_sec"] for row in table}
        | {f"{row['job']}_efficiency": row["efficiency"] for row in table if row["job"] != "one_device"},
    }


def markdown_table(result: dict[str, Any]) -> str:
    """The table as Markdown rows (for docs/figures.md)."""
    lines = ["| job | devices | images/sec | per device | speed-up | efficiency |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in result["table"]:
        lines.append(f"| {row['job']} | {row['devices']} | {row['images_per_sec']:.1f} | "
                     f"{row['images_per_sec_per_device']:.1f} | {row['speedup']:.2f} | {row['efficiency']:.2f} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str):
    """Speed-up against devices for each job kind, with the ideal line (the scaling plot's layout)."""
    by_kind: dict[str, list[dict]] = {}
    for row in result["table"]:
        kind = row["job"].rsplit("_", 1)[0] if row["job"][-1].isdigit() else row["job"]
        by_kind.setdefault(kind, []).append({"devices": row["devices"], "speedup": row["speedup"]})
    one = {"devices": 1, "speedup": 1.0}
    table = {kind: ([one] if kind != "one_device" else []) + rows for kind, rows in by_kind.items()}
    size = result["image_size"]
    return scaling_plot({"table": table, "model": f"{result['model'].split('.')[-1]}, {size}x{size} synthetic",
                         "batch_per_device": result["batch_per_device"]}, path)
