"""The `tfdist` command: train, config, bench.

    tfdist train --config configs/default.yaml [--set train.epochs=5] [--metrics_out m.json]
    tfdist config --config configs/default.yaml [--set ...]
    tfdist bench overhead --json overhead.json
    tfdist bench synthetic --model keras.applications.MobileNetV2 --image_size 64 --json s.json --plot s.png
    tfdist launch --workers 2 [--ps 1] [--chief] --config configs/horovod.yaml [--set ...]
    tfdist launch --workers 2 --config my.yaml -- python train.py --my_flag 3   # a script of your own
    tfdist slurm --tasks 4 --config configs/parameter_server.yaml | sbatch --wait
    tfdist k8s --image REPO/tfdist:0.1 --workers 2 --config configs/parameter_server.yaml --out k8s/
    tfdist plan --config configs/tensor_parallel.yaml --cluster 2x8-a100-80g-ib --out plan.yaml

`tfdist --help` lists the commands, `tfdist COMMAND --help` (or -h) the
command's own flags. launch, slurm and k8s run `tfdist train` on every task,
or the command after `--`. A bad config, a bad flag value or a flag the command does
not take prints one line, `tfdist: error: ...`, and exits 2; a cluster that
loses or never finds a task prints one line and exits 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Callable

from absl import app, flags
from absl import logging as absl_logging

from tfdist.errors import CheckpointWriteError, ClusterError, ConfigError, HostsError, MemoryLimitError
from tfdist.tf_startup import import_tensorflow, quiet_tensorflow_log

# Each command takes only its own flags (the table at the end); the help strings are shown per command.
_CONFIG = flags.DEFINE_string("config", None, "YAML config file; the built-in defaults when omitted.")
_SET = flags.DEFINE_multi_string("set", [], "Override one key: section.key=value, the value in YAML (repeatable).")
_METRICS_OUT = flags.DEFINE_string("metrics_out", None, "Write the job's results as JSON here.")
_JSON = flags.DEFINE_string("json", None, "Write the benchmark's JSON here.")
_PLOT = flags.DEFINE_string("plot", None, "network, scaling and synthetic: write the plot (PNG) here.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds per variant (the median is taken).", lower_bound=1)
_MODEL = flags.DEFINE_string("model", None, "synthetic, network: the model, a model.name "
                              "(e.g. keras.applications.ResNet50); network also takes sparse_embedding "
                              "(a large embedding table that each batch touches sparsely).")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", None, "synthetic: side of the square images (default 64).",
                                   lower_bound=4)
_BATCH_PER_DEVICE = flags.DEFINE_integer("batch_per_device", None, "synthetic: images per device per step "
                                         "(default 32).", lower_bound=1)
_LINKS = flags.DEFINE_string("links", None, "network, plan: the link rates to run at, comma-separated "
                             "(default 100mbit,1gbit,10gbit).")
_KINDS = flags.DEFINE_string("kinds", None, "network, plan: the kinds to run, comma-separated "
                             "(default multi_worker,horovod,parameter_server; plan: multi_worker,horovod on "
                             "namespace hosts, or pipeline,tensor_parallel in one process).")
_WORKERS = flags.DEFINE_integer("workers", 1, "Worker processes (launch) or pods (k8s); under Horovod, ranks.")
_PS = flags.DEFINE_integer("ps", 0, "Parameter servers (0: parameter_server.num_ps).", lower_bound=0)
_CHIEF = flags.DEFINE_bool("chief", False, "Add a chief task to a multi-worker job.")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 0, "Run the job again after a failure, up to this many times "
                                     "(it resumes from checkpoint.dir); preemptions (exit 75) do not count.",
                                     lower_bound=0)
_HOSTS = flags.DEFINE_integer("hosts", 0, "launch: run the tasks on this many hosts, network namespaces of this "
                               "machine on a private bridge (needs root; 0: every task on loopback). plan: the hosts "
                               "the devices are spread over (0: one).", lower_bound=0)
_LINK = flags.DEFINE_string("link", None, "With --hosts: each host's link rate in tc's notation (100mbit, 1gbit, "
                            "10gbit); launch leaves links unshaped when omitted.")
_DEVICES = flags.DEFINE_integer("devices", None, "plan: devices in all (with --cluster: its own).", lower_bound=1)
_DEVICE_MEMORY = flags.DEFINE_string("device_memory", None, "plan: memory per device, e.g. 80GiB (unchecked when "
                                     "omitted).")
_DEVICE_TFLOPS = flags.DEFINE_float("device_tflops", None, "plan: sustained TFLOP/s of one device in a training "
                                    "step (with neither it, --cluster nor --measure: memory alone).", lower_bound=0)
_INTRA_LINK = flags.DEFINE_string("intra_link", None, "plan: the rate between two devices of a host, e.g. 600GB/s "
                                  "or 100gbit (omitted: what moves within a host is not counted).")
_LINK_LATENCY = flags.DEFINE_string("link_latency", None, "plan: what a training step across hosts costs beyond "
                                    "its bytes, e.g. 2ms (omitted: not counted).")
_HOST_RATE = flags.DEFINE_string("host_rate", None, "plan: the bytes a second a host's transport serializes and "
                                  "copies on top of the wire time, e.g. 300MB/s for gRPC on busy cores (omitted: not "
                                  "counted).")
_VARIABLE_LATENCY = flags.DEFINE_string("variable_latency", None, "plan: what each trainable variable adds to a "
                                        "parameter-server worker's step beyond its bytes (its read and its update are "
                                        "RPCs of their own), e.g. 0.2ms (omitted: not counted).")
_CLUSTER = flags.DEFINE_string("cluster", None, "plan: a preset cluster: 1x8-a100-80g, 2x8-a100-80g-ib, "
                               "1x8-v100-32g, or a published run's, 128x4-p100-25g-roce or 32x8-p100-50g (its source "
                               "is printed).")
_MEASURE = flags.DEFINE_bool("measure", False, "plan: time the model's training step on one device of this "
                             "machine for the device rate, and a pipeline's stages on their micro-batches.")
_EVERY_TASK = flags.DEFINE_bool("every_task", False, "With a command after --, under parameter servers: run it on "
                                 "every task (a script that serves on its workers and parameter servers itself); by "
                                 "default the chief runs it and the others are tfdist's servers (tfdist serve).")
_STALLED_SECONDS = flags.DEFINE_integer("stalled_seconds", 20, "launch: how long a task may stay stopped "
                                         "(SIGSTOP) before the job ends, naming it.", lower_bound=1)
_TASKS = flags.DEFINE_integer("tasks", None, "Slurm tasks (processes) of the job; required.")
_NODES = flags.DEFINE_integer("nodes", None, "Nodes (#SBATCH --nodes).")
_GPUS_PER_NODE = flags.DEFINE_integer("gpus-per-node", None, "GPUs per node (#SBATCH --gpus-per-node).")
_PARTITION = flags.DEFINE_string("partition", None, "Partition (#SBATCH --partition).")
_TIME = flags.DEFINE_string("time", None, "Time limit (#SBATCH --time).")
_OVERCOMMIT = flags.DEFINE_bool("overcommit", False, "More tasks than CPUs on a node (#SBATCH --overcommit).")
_REQUEUE = flags.DEFINE_bool("requeue", False, "Requeue the job (scontrol requeue) when it is preempted (its "
                             "tasks exit 75), so it runs again and resumes from checkpoint.dir.")
_IMAGE = flags.DEFINE_string("image", None, "The container image, with tfdist installed.")
_OUT = flags.DEFINE_string("out", None, "k8s: the directory the manifests are written to (required). plan: the "
                           "file the recommended layout's config is written to.")
_NAME = flags.DEFINE_string("name", "tfdist", "The job's name (objects and pod hostnames start with it).")
_FLAVOR = flags.DEFINE_enum("flavor", "jobs", ["jobs", "jobset", "tfjob"],
                            "Indexed Jobs and a Service, one JobSet, or a Kubeflow TFJob.")
_GPUS_PER_WORKER = flags.DEFINE_integer("gpus-per-worker", 0, "nvidia.com/gpu per worker pod.", lower_bound=0)
_CPU = flags.DEFINE_string("cpu", "2", "CPU request per pod.")
_MEMORY = flags.DEFINE_string("memory", "8Gi", "Memory request per pod.")
_QUEUE = flags.DEFINE_string("queue", None, "Kueue LocalQueue; the job starts suspended until admitted.")
_NAMESPACE = flags.DEFINE_string("namespace", None, "The namespace of every object.")
_PRIORITY_CLASS = flags.DEFINE_string("priority-class", None, "The pods' PriorityClass.")

EXIT_USAGE = 2
EXIT_RUNTIME = 1


def _fail(message: str) -> None:
    print(f"tfdist: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _load(tfdist_train: bool = True):
    """The config of the job a command runs, launches or plans; for `tfdist train`'s, its model and data are
    checked too (a user's own script, or its servers, read only the strategy's keys)."""
    from tfdist.config import load_config
    from tfdist.config.validation import check_job

    config = load_config(_CONFIG.value, _SET.value)
    if tfdist_train:
        check_job(config)
    return config


def _user_command(name: str, args: list[str]) -> list[str]:
    """The command after `--` that launch, slurm and k8s run on the tasks instead of `tfdist train`; []
    without one."""
    if args[:1] != ["--"]:
        if args:
            _fail(f"`{name}` takes no arguments; a command of your own goes after --: "
                  f"`tfdist {name} [flags] -- python train.py`. Received: {' '.join(args)}")
        if _EVERY_TASK.value:
            _fail("--every_task runs a command of your own on every task: give one after --.")
        return []
    if len(args) == 1:
        _fail(f"`{name}` needs a command after --, e.g. `tfdist {name} [flags] -- python train.py`.")
    if _METRICS_OUT.value:
        _fail(f"--metrics_out is tfdist train's; a command of your own writes its own results. "
              f"Received: {_METRICS_OUT.value}")
    return args[1:]


def _config_command(args) -> None:
    import yaml

    from tfdist.config import to_dict

    if args:
        _fail(f"`config` takes no arguments. Received: {' '.join(args)}")
    print(yaml.safe_dump(to_dict(_load()), sort_keys=False), end="")


def _train_command(args) -> None:
    if args:
        _fail(f"`train` takes no arguments. Received: {' '.join(args)}")
    config = _load()  # a config error is one line at once, before TensorFlow takes seconds to load
    import_tensorflow()
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
               (("model", _MODEL), ("image_size", _IMAGE_SIZE), ("batch_per_device", _BATCH_PER_DEVICE),
                ("links", _LINKS), ("kinds", _KINDS))
               if flag.value is not None}
    result = bench.run(args[0], config=config, repeats=_REPEATS.value, plot_path=_PLOT.value, **options)
    if _JSON.value:
        from tfdist.reporting import write_json

        write_json(_JSON.value, result)
    print(bench.one_line(result))


def _train_args() -> list[str]:
    """The flags that make `tfdist train` (or `tfdist serve`) in another process run this job."""
    config = ["--config", os.path.abspath(_CONFIG.value)] if _CONFIG.value else []
    metrics = [f"--metrics_out={os.path.abspath(_METRICS_OUT.value)}"] if _METRICS_OUT.value else []
    return [*config, *(f"--set={s}" for s in _SET.value), *metrics]


def _serve_command(args) -> None:
    if args:
        _fail(f"`serve` takes no arguments. Received: {' '.join(args)}")
    config = _load(tfdist_train=False)  # the servers of a user's script
    import_tensorflow()
    from tfdist.strategies.factory import serves_only

    if not serves_only(config):
        _fail("`serve` runs a worker or parameter server of a parameter-server job: it needs "
              "strategy.kind=parameter_server and a cluster (TF_CONFIG, the cluster section or cluster.resolver) "
              f"whose task for this process is a worker or ps. Received: strategy.kind={config.strategy.kind}")


def _kind_given() -> bool:
    """Whether the job's strategy kind is chosen, by the config file or by --set."""
    from tfdist.config.loading import read_yaml

    if any(override.split("=", 1)[0].strip() == "strategy.kind" for override in _SET.value):
        return True
    strategy = (read_yaml(_CONFIG.value) if _CONFIG.value else {}).get("strategy")
    return isinstance(strategy, dict) and "kind" in strategy


def _kind_across(launcher: str, processes: int, what: str, ps: int = 0, chief: bool = False) -> None:
    """As torchrun: a job of several processes and no strategy kind given trains across them (one process is
    mirrored's, the default): multi_worker_mirrored, or parameter_server with parameter servers. Says so."""
    if (processes > 1 or ps or chief) and not _kind_given():
        kind = "parameter_server" if ps else "multi_worker_mirrored"
        flags.FLAGS.set = [*_SET.value, f"strategy.kind={kind}"]
        print(f"tfdist {launcher}: no strategy.kind given: {processes} {what} as strategy.kind={kind} "
              "(--set strategy.kind=... chooses another)", file=sys.stderr)


def _launch_command(args) -> None:
    from tfdist.launch import local as launch
    from tfdist.launch.hosts import NamespaceHosts

    command = _user_command("launch", args)
    _kind_across("launch", _WORKERS.value, "workers", ps=_PS.value, chief=_CHIEF.value)
    config = _load(tfdist_train=not command)
    if _LINK.value and not _HOSTS.value:
        _fail("--link shapes the links of --hosts: give --hosts N too.")
    hosts = NamespaceHosts(_HOSTS.value, _LINK.value) if _HOSTS.value else None

    def plan():
        return launch.plan(config, _train_args(), workers=_WORKERS.value, ps=_PS.value, chief=_CHIEF.value,
                           hosts=hosts, command=command, every_task=_EVERY_TASK.value)

    try:
        code = launch.run(plan(), max_restarts=_MAX_RESTARTS.value, replan=plan, hosts=hosts,
                          stalled_seconds=_STALLED_SECONDS.value)
    finally:
        if hosts:
            hosts.close()  # every process left in them, the namespaces, links and bridge
    sys.exit(code)


def _slurm_command(args) -> None:
    from tfdist.launch import slurm

    command = _user_command("slurm", args)
    if _TASKS.value is None:
        _fail("`slurm` needs --tasks, the number of Slurm tasks (processes).")
    _kind_across("slurm", _TASKS.value, "tasks")
    script = slurm.sbatch_script(
        _load(tfdist_train=not command), _train_args(), tasks=_TASKS.value, nodes=_NODES.value,
        gpus_per_node=_GPUS_PER_NODE.value, partition=_PARTITION.value, time_limit=_TIME.value,
        overcommit=_OVERCOMMIT.value, requeue=_REQUEUE.value, command=command, every_task=_EVERY_TASK.value,
    )
    print(script, end="")


def _k8s_command(args) -> None:
    from tfdist.launch import k8s
    from tfdist.launch.k8s_validation import KUBERNETES_VERSION, missing_packages, validate

    command = _user_command("k8s", args)
    if missing_packages():
        _fail(f"`k8s` validates what it writes with {', '.join(missing_packages())}: pip install 'tfdist[k8s]'.")
    if not _OUT.value:
        _fail("`k8s` needs --out, the directory to write the manifests to.")
    _kind_across("k8s", _WORKERS.value, "workers", ps=_PS.value)
    job = k8s.Job(
        name=_NAME.value, image=_IMAGE.value or "", workers=_WORKERS.value, ps=_PS.value,
        gpus_per_worker=_GPUS_PER_WORKER.value, cpu=_CPU.value, memory=_MEMORY.value, flavor=_FLAVOR.value,
        queue=_QUEUE.value, namespace=_NAMESPACE.value, priority_class=_PRIORITY_CLASS.value,
        metrics_out=_METRICS_OUT.value, command=tuple(command), every_task=_EVERY_TASK.value,
    )
    objects = k8s.manifests(_load(tfdist_train=not command), job)
    for obj in objects:  # all of them before any file is written
        validate(obj)
    for path in k8s.write(objects, _OUT.value):
        print(path)
    print(f"# valid for Kubernetes {KUBERNETES_VERSION}; run it with: kubectl apply -f {_OUT.value}", file=sys.stderr)


def _plan_command(args) -> None:
    from tfdist import plan

    if args:
        _fail(f"`plan` takes no arguments. Received: {' '.join(args)}")
    config = _load()
    dtype = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}.get(config.precision.policy.value, "float32")
    if _CLUSTER.value:
        cluster = plan.from_preset(_CLUSTER.value, _HOSTS.value or None, dtype)
    elif not _DEVICES.value:
        _fail("`plan` needs the devices: --devices N (with --hosts, --device_memory, --link, --intra_link), or "
              "--cluster NAME.")
    else:
        cluster = plan.Cluster(
            devices=_DEVICES.value, hosts=_HOSTS.value or 1,
            device_memory=plan.parse_bytes(_DEVICE_MEMORY.value, "--device_memory") if _DEVICE_MEMORY.value else 0.0,
            device_flops=(_DEVICE_TFLOPS.value or 0.0) * 1e12,
            link=plan.parse_rate(_LINK.value, "--link") if _LINK.value else 0.0,
            intra_link=plan.parse_rate(_INTRA_LINK.value, "--intra_link") / 8 if _INTRA_LINK.value else 0.0)
    if _LINK_LATENCY.value:
        cluster = dataclasses.replace(cluster, link_latency=plan.parse_duration(_LINK_LATENCY.value, "--link_latency"))
    if _HOST_RATE.value:
        cluster = dataclasses.replace(cluster, host_rate=plan.parse_rate(_HOST_RATE.value, "--host_rate") / 8)
    if _VARIABLE_LATENCY.value:
        cluster = dataclasses.replace(
            cluster, variable_latency=plan.parse_duration(_VARIABLE_LATENCY.value, "--variable_latency"))
    if _OUT.value and not (cluster.device_flops or _MEASURE.value):
        _fail(f"`plan --out` writes the fastest layout, so it needs the devices' speed: {plan.SPEED_FLAGS}.")
    import_tensorflow()
    if _MEASURE.value:  # one device of this machine, set up as the job sets up its runtime, before anything runs
        from tfdist.strategies.devices import configure_runtime

        one_device = plan.one_device_config(config, max(1, config.train.global_batch_size // cluster.devices))
        configure_runtime(one_device)
    model = plan.profile(config)
    measured = None
    if _MEASURE.value:
        measured = plan.MeasuredTimes(one_device, model)
        cores = plan.shared_cores()
        cluster = dataclasses.replace(
            cluster, device_flops=measured.device_flops, host_cores=cores,
            source=f"{cluster.source}; device rate measured here" +
                   (f"; logical CPU devices sharing its {cores} cores" if cores else ""))
    result = plan.make_plan(config, cluster, model, measured)
    print(plan.table(result))
    if _JSON.value:
        from tfdist.reporting import write_json

        write_json(_JSON.value, result)
    if _OUT.value and result["recommended"]:
        import yaml

        from tfdist.config import load_config, to_dict

        recommended = load_config(_CONFIG.value, [*_SET.value, *result["recommended_overrides"]])
        with open(_OUT.value, "w", encoding="utf-8") as f:
            f.write(f"# tfdist plan: {result['recommended']['layout']}, predicted "
                    f"{result['recommended']['samples_per_sec']:.4g} samples/sec\n")
            yaml.safe_dump(to_dict(recommended), f, sort_keys=False)
        print(f"wrote {_OUT.value}")


@dataclasses.dataclass(frozen=True)
class _Command:
    """One `tfdist` command: what it does, the flags it takes, and its function."""

    summary: str
    flags: tuple
    run: Callable[[list[str]], None]
    positional: str = ""
    runs_a_command: bool = False  # takes `-- COMMAND` to run instead of `tfdist train`


_JOB = (_CONFIG, _SET)
_COMMANDS = {
    "train": _Command("train the configured model and print the summary", (*_JOB, _METRICS_OUT), _train_command),
    "config": _Command("print the resolved config as YAML", _JOB, _config_command),
    "bench": _Command("run a benchmark and print its one-line summary", (_JSON, *_JOB, _REPEATS, _PLOT, _MODEL,
                      _IMAGE_SIZE, _BATCH_PER_DEVICE, _LINKS, _KINDS), _bench_command, positional="NAME"),
    "plan": _Command("predict every layout's memory and speed on a cluster; write the best as a config",
                     (*_JOB, _DEVICES, _HOSTS, _DEVICE_MEMORY, _DEVICE_TFLOPS, _LINK, _INTRA_LINK, _LINK_LATENCY,
                      _HOST_RATE, _VARIABLE_LATENCY, _CLUSTER, _MEASURE, _JSON, _OUT), _plan_command),
    "launch": _Command("run every task of a multi-process job on this machine",
                       (_WORKERS, _PS, _CHIEF, _HOSTS, _LINK, _MAX_RESTARTS, _STALLED_SECONDS, _EVERY_TASK, *_JOB,
                        _METRICS_OUT),
                       _launch_command, runs_a_command=True),
    "slurm": _Command("print an sbatch script for the job: tfdist slurm ... | sbatch",
                      (_TASKS, _NODES, _GPUS_PER_NODE, _PARTITION, _TIME, _OVERCOMMIT, _REQUEUE, _EVERY_TASK, *_JOB,
                       _METRICS_OUT), _slurm_command, runs_a_command=True),
    "k8s": _Command("write validated Kubernetes manifests for the job",
                    (_IMAGE, _WORKERS, _PS, _OUT, _FLAVOR, _GPUS_PER_WORKER, _CPU, _MEMORY, _QUEUE, _NAMESPACE,
                     _PRIORITY_CLASS, _NAME, _EVERY_TASK, *_JOB, _METRICS_OUT), _k8s_command,
                    runs_a_command=True),
    "serve": _Command("serve a parameter-server job's worker or ps task (its cluster from TF_CONFIG) until "
                      "the chief is done", _JOB, _serve_command),
}
_HELP = ("-h", "--help", "--helpshort", "--helpfull", "help")


def _usage() -> str:
    lines = ["usage: tfdist COMMAND [flags]", "", "commands:"]
    lines += [f"  {name:<8} {command.summary}" for name, command in _COMMANDS.items()]
    lines += ["", "`tfdist COMMAND --help` lists a command's flags."]
    return "\n".join(lines)


def _command_help(name: str) -> str:
    command = _COMMANDS[name]
    usage = f"tfdist {name} {command.positional + ' ' if command.positional else ''}[flags]"
    lines = [f"usage: {usage}{' [-- COMMAND [ARGS...]]' if command.runs_a_command else ''}", "", command.summary + "."]
    if command.runs_a_command:
        lines.append("Every task runs `tfdist train`, or COMMAND: a script of your own, which finds its cluster as "
                     "tfdist.make_strategy does (TF_CONFIG, or the launcher's cluster.resolver).")
    if name == "bench":
        from tfdist.bench import BENCHMARKS

        lines.append(f"NAME is one of: {', '.join(BENCHMARKS)}.")
    lines += ["", "flags:"]
    for holder in command.flags:
        default = holder.default
        if isinstance(default, bool):
            default = str(default).lower()
        shown = "" if default in (None, [], "") else f" (default: {default})"
        # absl appends its own sentences to the help ("repeat this option...", the bounds); ours say it.
        help_text = flags.FLAGS[holder.name].help.split(";\n")[0]
        lines.append(f"  --{holder.name}: {help_text}{shown}")
    return "\n".join(lines)


def _parse(argv: list[str]) -> list[str]:
    """Parses `tfdist COMMAND [flags]`: help, one-line flag errors, only the command's own flags.

    absl's own parser would take the console-script wrapper for the main module
    (its help shows nothing) and accept every command's flags for every command.
    """
    if len(argv) < 2 or argv[1] in _HELP:
        print(_usage(), file=sys.stdout if len(argv) > 1 else sys.stderr)
        if len(argv) > 1:
            sys.exit(0)
        _fail(f"the command must be one of {', '.join(_COMMANDS)}. Received: nothing")
    name = argv[1]
    if name not in _COMMANDS:
        print(_usage(), file=sys.stderr)
        _fail(f"the command must be one of {', '.join(_COMMANDS)}. Received: {name}")
    own, command = argv[2:], []  # the command after `--` is the user's, flags and all
    if "--" in own:
        own, command = own[:own.index("--")], own[own.index("--"):]
    if any(arg in _HELP[:-1] for arg in own):
        print(_command_help(name))
        sys.exit(0)
    try:
        rest = flags.FLAGS([argv[0], *own])
    except flags.Error as e:
        _fail(f"{e}. See `tfdist {name} --help`.")
    taken = {holder.name for holder in _COMMANDS[name].flags}
    given = sorted({flags.FLAGS[f].name for f in flags.FLAGS if flags.FLAGS[f].present} - taken)
    if given:
        _fail(f"`{name}` does not take --{', --'.join(given)}; its flags are --{', --'.join(sorted(taken))} "
              f"(see `tfdist {name} --help`). Received: --{given[0]}")
    return [argv[0], name, *rest[1:], *command]


def main(argv: list[str]) -> None:
    # absl logs at INFO, and TensorFlow's Python INFO lines (device lists,
    # collective set-up) would drown the progress bar.
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        _COMMANDS[argv[1]].run(argv[2:])
    except ConfigError as e:
        _fail(str(e))
    except (HostsError, CheckpointWriteError, MemoryLimitError) as e:
        print(f"tfdist: error: {e}", file=sys.stderr)
        sys.exit(EXIT_RUNTIME)
    except ClusterError as e:
        print(f"tfdist: error: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # Not sys.exit: interpreter teardown would wait on the lost task's
        # remote executors and print their tracebacks after our one line.
        os._exit(EXIT_RUNTIME)


def run() -> None:
    """Console-script entry point."""
    quiet_tensorflow_log()
    app.run(main, flags_parser=_parse)


if __name__ == "__main__":
    run()
