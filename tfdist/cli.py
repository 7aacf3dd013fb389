"""The `tfdist` command: train, config, bench.

    tfdist train --config configs/default.yaml [--set train.epochs=5] [--metrics_out m.json]
    tfdist config --config configs/default.yaml [--set ...]
    tfdist bench overhead --json overhead.json
    tfdist bench synthetic --model keras.applications.MobileNetV2 --image_size 64 --json s.json --plot s.png
    tfdist launch --workers 2 [--ps 1] [--chief] --config configs/horovod.yaml [--set ...]
    tfdist slurm --tasks 4 --config configs/parameter_server.yaml | sbatch --wait
    tfdist k8s --image REPO/tfdist:0.1 --workers 2 --config configs/parameter_server.yaml --out k8s/

A bad config prints one line, `tfdist: error: ...`, and exits 2; a cluster
that loses or never finds a task prints one line and exits 1.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging

from tfdist.errors import ClusterError, ConfigError

_CONFIG = flags.DEFINE_string("config", None, "YAML config file; the built-in defaults when omitted.")
_SET = flags.DEFINE_multi_string("set", [], "Override one key: section.key=value (repeatable).")
_METRICS_OUT = flags.DEFINE_string("metrics_out", None, "train: write the results as JSON here.")
_JSON = flags.DEFINE_string("json", None, "bench: write the benchmark's JSON here.")
_PLOT = flags.DEFINE_string("plot", None, "bench scaling, synthetic: write the speed-up plot (PNG) here.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "bench: timed rounds per variant (median taken).", lower_bound=1)
_MODEL = flags.DEFINE_string("model", None, "bench synthetic: the model (a model.name, e.g. keras.applications.ResNet50).")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", None, "bench synthetic: side of the square images (default 64).",
                                   lower_bound=4)
_BATCH_PER_DEVICE = flags.DEFINE_integer("batch_per_device", None, "bench synthetic: images per device per step "
                                         "(default 32).", lower_bound=1)
_WORKERS = flags.DEFINE_integer("workers", 1, "launch: worker processes (Horovod: ranks).")
_PS = flags.DEFINE_integer("ps", 0, "launch: parameter servers (default: parameter_server.num_ps).", lower_bound=0)
_CHIEF = flags.DEFINE_bool("chief", False, "launch: add a chief task to a multi-worker job.")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 0, "launch: run the job again after a failure, up to this "
                                     "many times (it resumes from checkpoint.dir).", lower_bound=0)
_TASKS = flags.DEFINE_integer("tasks", None, "slurm: Slurm tasks (processes) of the job.")
_NODES = flags.DEFINE_integer("nodes", None, "slurm: nodes (#SBATCH --nodes).")
_GPUS_PER_NODE = flags.DEFINE_integer("gpus-per-node", None, "slurm: GPUs per node (#SBATCH --gpus-per-node).")
_PARTITION = flags.DEFINE_string("partition", None, "slurm: partition (#SBATCH --partition).")
_TIME = flags.DEFINE_string("time", None, "slurm: time limit (#SBATCH --time).")
_OVERCOMMIT = flags.DEFINE_bool("overcommit", False, "slurm: more tasks than CPUs on a node (#SBATCH --overcommit).")
_IMAGE = flags.DEFINE_string("image", None, "k8s: the container image, with tfdist installed.")
_OUT = flags.DEFINE_string("out", None, "k8s: the directory the manifests are written to.")
_NAME = flags.DEFINE_string("name", "tfdist", "k8s: the job's name (objects and pod hostnames start with it).")
_FLAVOR = flags.DEFINE_enum("flavor", "jobs", ["jobs", "jobset", "tfjob"],
                            "k8s: Indexed Jobs and a Service, one JobSet, or a Kubeflow TFJob.")
_GPUS_PER_WORKER = flags.DEFINE_integer("gpus-per-worker", 0, "k8s: nvidia.com/gpu per worker pod.", lower_bound=0)
_CPU = flags.DEFINE_string("cpu", "2", "k8s: CPU request per pod.")
_MEMORY = flags.DEFINE_string("memory", "8Gi", "k8s: memory request per pod.")
_QUEUE = flags.DEFINE_string("queue", None, "k8s: Kueue LocalQueue; the job starts suspended until admitted.")
_NAMESPACE = flags.DEFINE_string("namespace", None, "k8s: the namespace of every object.")
_PRIORITY_CLASS = flags.DEFINE_string("priority-class", None, "k8s: the pods' PriorityClass.")

USAGE = """usage: tfdist COMMAND [flags]

commands:
  train          train the configured model (--config, --set, --metrics_out)
  config         print the resolved config as YAML (--config, --set)
  slurm          print an sbatch script for the job (--tasks, --nodes, --gpus-per-node, --partition, --time,
                 --overcommit, and train's flags): tfdist slurm ... | sbatch
  launch         run every task of a multi-process job here (--workers, --ps, --chief, --max_restarts, and
                 train's flags)
  k8s            write validated Kubernetes manifests for the job (--image, --workers, --ps, --out, --flavor,
                 --gpus-per-worker, --cpu, --memory, --queue, --namespace, --priority-class, --name)
  bench NAME     run a benchmark (--json, --config, --set, --repeats; --plot for scaling and synthetic;
                 --model, --image_size, --batch_per_device for synthetic); NAME is one of:
                 {benches}
"""

EXIT_USAGE = 2
EXIT_RUNTIME = 1


def _fail(message: str) -> None:
    print(f"tfdist: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _load():
    from tfdist.config import load_config

    return load_config(_CONFIG.value, _SET.value)


def _config_command(args) -> None:
    import yaml

    from tfdist.config import to_dict

    if args:
        _fail(f"`config` takes no arguments. Received: {' '.join(args)}")
    print(yaml.safe_dump(to_dict(_load()), sort_keys=False), end="")


def _train_command(args) -> None:
    if args:
        _fail(f"`train` takes no arguments. Received: {' '.join(args)}")
    config = _load()
    from tfdist import training

    training.run(config, metrics_out=_METRICS_OUT.value)


def _bench_command(args) -> None:
    from tfdist import bench

    if len(args) != 1 or args[0] not in bench.BENCHMARKS:
        _fail(
            f"`bench` takes one benchmark name: {', '.join(bench.BENCHMARKS)}. "
            f"Received: {' '.join(args) or 'nothing'}"
        )
    config = _load() if (_CONFIG.value or _SET.value) else None
    options = {name: flag.value for name, flag in
               (("model", _MODEL), ("image_size", _IMAGE_SIZE), ("batch_per_device", _BATCH_PER_DEVICE))
               if flag.value is not None}
    result = bench.run(args[0], config=config, repeats=_REPEATS.value, plot_path=_PLOT.value, **options)
    if _JSON.value:
        from tfdist.reporting import write_json

        write_json(_JSON.value, result)
    print(bench.one_line(result))


def _train_args() -> list[str]:
    """The flags that make `tfdist train` in another process run this job."""
    config = ["--config", os.path.abspath(_CONFIG.value)] if _CONFIG.value else []
    metrics = [f"--metrics_out={os.path.abspath(_METRICS_OUT.value)}"] if _METRICS_OUT.value else []
    return [*config, *(f"--set={s}" for s in _SET.value), *metrics]


def _launch_command(args) -> None:
    from tfdist import launch

    if args:
        _fail(f"`launch` takes no arguments. Received: {' '.join(args)}")
    config = _load()

    def plan():
        return launch.plan(config, _train_args(), workers=_WORKERS.value, ps=_PS.value, chief=_CHIEF.value)

    sys.exit(launch.run(plan(), max_restarts=_MAX_RESTARTS.value, replan=plan))


def _slurm_command(args) -> None:
    from tfdist import slurm

    if args:
        _fail(f"`slurm` takes no arguments. Received: {' '.join(args)}")
    if _TASKS.value is None:
        _fail("`slurm` needs --tasks, the number of Slurm tasks (processes).")
    script = slurm.sbatch_script(
        _load(), _train_args(), tasks=_TASKS.value, nodes=_NODES.value, gpus_per_node=_GPUS_PER_NODE.value,
        partition=_PARTITION.value, time_limit=_TIME.value, overcommit=_OVERCOMMIT.value,
    )
    print(script, end="")


def _k8s_command(args) -> None:
    from tfdist import k8s
    from tfdist.k8s_validation import KUBERNETES_VERSION, missing_packages, validate

    if args:
        _fail(f"`k8s` takes no arguments. Received: {' '.join(args)}")
    if missing_packages():
        _fail(f"`k8s` validates what it writes with {', '.join(missing_packages())}: pip install 'tfdist[k8s]'.")
    if not _OUT.value:
        _fail("`k8s` needs --out, the directory to write the manifests to.")
    job = k8s.Job(
        name=_NAME.value, image=_IMAGE.value or "", workers=_WORKERS.value, ps=_PS.value,
        gpus_per_worker=_GPUS_PER_WORKER.value, cpu=_CPU.value, memory=_MEMORY.value, flavor=_FLAVOR.value,
        queue=_QUEUE.value, namespace=_NAMESPACE.value, priority_class=_PRIORITY_CLASS.value,
        metrics_out=_METRICS_OUT.value,
    )
    objects = k8s.manifests(_load(), job)
    for obj in objects:  # all of them before any file is written
        validate(obj)
    for path in k8s.write(objects, _OUT.value):
        print(path)
    print(f"# valid for Kubernetes {KUBERNETES_VERSION}; run it with: kubectl apply -f {_OUT.value}", file=sys.stderr)


_COMMANDS = {"train": _train_command, "config": _config_command, "bench": _bench_command, "launch": _launch_command,
             "slurm": _slurm_command, "k8s": _k8s_command}


def main(argv: list[str]) -> None:
    # absl logs at INFO, and TensorFlow's Python INFO lines (device lists,
    # collective set-up) would drown the progress bar.
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    absl_logging.set_verbosity(absl_logging.WARNING)
    if len(argv) < 2 or argv[1] not in _COMMANDS:
        from tfdist.bench import BENCHMARKS

        print(USAGE.format(benches=", ".join(BENCHMARKS)), file=sys.stderr)
        received = argv[1] if len(argv) > 1 else "nothing"
        _fail(f"the command must be one of {', '.join(_COMMANDS)}. Received: {received}")
    try:
        _COMMANDS[argv[1]](argv[2:])
    except ConfigError as e:
        _fail(str(e))
    except ClusterError as e:
        print(f"tfdist: error: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # Not sys.exit: interpreter teardown would wait on the lost task's
        # remote executors and print their tracebacks after our one line.
        os._exit(EXIT_RUNTIME)


def run() -> None:
    """Console-script entry point."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads
    app.run(main)


if __name__ == "__main__":
    run()
