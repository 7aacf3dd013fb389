"""Checks that span several config fields, and checks against the machine.

`check` runs at load and needs no TensorFlow. `check_devices` and
`check_batch_split` need to know what the machine has, so the strategy factory
calls them with the numbers it found.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

from tfdist.config.kinds import GATED_OPTIONS, KINDS, RANKS, backends_taking, kinds_taking, kinds_where
from tfdist.config.schema import (
    AllReduce,
    ClusterResolverKind,
    Config,
    DataParallel,
    FeatureDtype,
    HorovodConfig,
    ModelName,
    PrecisionPolicy,
    StrategyConfig,
)
from tfdist.config.environment import HOSTS_SUBNET_ENV
from tfdist.config.sources import DataSource, data_source, model_source
from tfdist.errors import ConfigError

__all__ = [
    "check",
    "check_address",
    "check_batch_split",
    "check_pipeline_devices",
    "check_tensor_parallel_devices",
    "placement_pairs",
    "tensor_parallel_size",
    "check_devices",
    "parse_device",
]

_DEVICE = re.compile(r"^/(?:device:)?(cpu|gpu|tpu):(\d+)$", re.IGNORECASE)
_LOSS_SCALE_WORDS = ("dynamic", "none")
# What an option's refusal adds after naming the kinds that take it.
_ELSEWHERE = {
    "gradient_compression": " (Horovod jobs set horovod.fp16_compression)",
    "data_parallel": " (the other kinds are their own data parallelism)",
}


def _kinds_where(has) -> str:
    return ", ".join(kinds_where(has))


def _taken_by(name: str) -> str:
    """Where a gated option or a section applies, for an error message: the kinds, and the data-parallel
    backends through which a pipeline or tensor-parallel job takes it."""
    where = f"strategy.kind={_either(kinds_taking(name))}"
    backends = backends_taking(name)
    return where + (f", or strategy.data_parallel={_either(backends)}" if backends else "")


def _either(names: list[str]) -> str:
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def check(config: Config) -> None:
    """Raises ConfigError for contradictions inside the config itself, in the keys a strategy and its runtime
    read (`check_job` adds the model and data of `tfdist train`)."""
    _check_strategy(config)
    _check_sections(config)
    _check_pipeline(config)
    _check_data_parallel(config)
    _check_placement(config)
    _check_layout(config)
    _check_precision(config)
    _check_train(config)
    _check_cluster(config)
    if config.checkpoint.every_seconds and config.strategy.launched_as.processes.lockstep:
        raise ConfigError("checkpoint.every_seconds", "would have each process save at its own step; "
                          f"{config.strategy.kind} saves at the same step in every process: use "
                          "checkpoint.every_steps.", config.checkpoint.every_seconds)
    if config.checkpoint.dir and config.callbacks.backup_dir:
        raise ConfigError("checkpoint.dir", "and callbacks.backup_dir both resume a job; keep one (checkpoint.dir "
                          "resumes mid-epoch and exactly).", config.checkpoint.dir)
    _check_callbacks(config)


def check_job(config: Config) -> None:
    """Raises ConfigError where the model and data `tfdist train` builds from `model.*` and `data.*` do not
    parse or do not fit the strategy. A user's own script, which builds its own, is not checked for them."""
    _check_sources(config)
    m, s = config.model, config.strategy
    if (s.spec.splits_tensors or s.tensor_parallel_size > 1) and m.name != ModelName.TRANSFORMER:
        raise ConfigError(
            "model.name",
            f"must be transformer with strategy.kind={s.kind}"
            f"{'' if s.spec.splits_tensors else ' and strategy.tensor_parallel_size > 1'}: "
            "the other models have no tensor-parallel layers, so nothing would be split.",
            m.name,
        )
    if m.name == ModelName.TRANSFORMER and m.width % m.heads:
        raise ConfigError("model.width", f"must divide by model.heads ({m.heads}) for transformer.", m.width)


def _check_strategy(config: Config) -> None:
    s = config.strategy
    kind = s.spec
    if s.all_reduce.value not in kind.all_reduce:
        raise ConfigError(
            "strategy.all_reduce",
            f"must be one of {', '.join(kind.all_reduce)} with strategy.kind={s.kind}.",
            s.all_reduce.value,
        )
    if s.num_packs != 1 and s.all_reduce not in (AllReduce.NCCL, AllReduce.HIERARCHICAL_COPY):
        raise ConfigError(
            "strategy.num_packs",
            "only applies to all_reduce nccl or hierarchical_copy with strategy.kind=mirrored; "
            "leave it at 1 otherwise.",
            s.num_packs,
        )
    defaults = StrategyConfig()
    for name in GATED_OPTIONS:
        value = getattr(s, name)
        if value != getattr(defaults, name) and not s.takes(name):
            raise ConfigError(f"strategy.{name}", f"only applies to {_taken_by(name)}{_ELSEWHERE.get(name, '')}; "
                              f"strategy.kind is {s.kind}.", getattr(value, "value", value))
    if s.shard_optimizer and s.kind == "pipeline" and s.tensor_parallel_size > 1:
        raise ConfigError("strategy.shard_optimizer", "cannot split the optimizer of a pipeline whose stages are "
                          f"split over strategy.tensor_parallel_size ({s.tensor_parallel_size}) devices in this "
                          "version; use strategy.kind tensor_parallel or layout.", s.shard_optimizer)
    if (s.shard_optimizer and s.kind == "layout" and config.layout.data_devices == 1
            and s.data_parallel == DataParallel.LOCAL):
        raise ConfigError("strategy.shard_optimizer", "splits the optimizer's state over the layout's data axis, and "
                          "layout.data_devices is 1 in one process: nothing would be split. Set layout.data_devices "
                          "to 2 or more, or strategy.data_parallel to multi_worker or horovod.", s.shard_optimizer)
    for name in ("keep_whole_below", "prefetch_weights"):
        value = getattr(s, name)
        if value != getattr(StrategyConfig(), name) and s.shard_optimizer != 3:
            raise ConfigError(f"strategy.{name}", "only applies with strategy.shard_optimizer: 3 (the weights "
                              f"split); strategy.shard_optimizer is {s.shard_optimizer}.", value)
    h = config.horovod
    if s.shard_optimizer and kind.processes is RANKS and (h.op.value == "adasum" or h.elastic
                                                          or h.backward_passes_per_step != 1):
        raise ConfigError("strategy.shard_optimizer", "cannot split the optimizer of a Horovod job with horovod.op "
                          "adasum (it combines whole gradients), horovod.elastic or horovod.backward_passes_per_step "
                          "above 1, in this version.", s.shard_optimizer)
    for i, name in enumerate(s.devices):
        parse_device(name, f"strategy.devices[{i}]")
    if len(set(d.lower() for d in s.devices)) != len(s.devices):
        raise ConfigError("strategy.devices", "must not name a device twice.", list(s.devices))
    if s.devices and not kind.local_devices:
        raise ConfigError(
            "strategy.devices",
            f"cannot be set with strategy.kind={s.kind}: it uses every local "
            "accelerator (or one CPU) of each task.",
            list(s.devices),
        )
    if kind.max_devices is not None and len(s.devices) > kind.max_devices:
        raise ConfigError(
            "strategy.devices", f"takes at most {kind.max_devices} device{'s' * (kind.max_devices != 1)} with "
            f"strategy.kind={s.kind}.",
            list(s.devices),
        )


def _check_sections(config: Config) -> None:
    """A section of some kinds' own settings, changed from its defaults under a kind that does not take it."""
    s = config.strategy
    for section in sorted({name for kind in KINDS.values() for name in kind.sections}):
        value = getattr(config, section)
        if value != type(value)() and not s.takes(section):
            raise ConfigError(section, f"only applies with {_taken_by(section)}; strategy.kind is {s.kind}.", "set")


def _check_pipeline(config: Config) -> None:
    p = config.pipeline
    if not config.strategy.takes("pipeline"):
        return
    if p.boundaries and len(p.boundaries) != p.num_stages - 1:
        raise ConfigError(
            "pipeline.boundaries",
            f"must name {p.num_stages - 1} layer(s), the first of each stage after the first "
            "(or be empty to balance automatically).",
            list(p.boundaries),
        )
    if len(set(p.boundaries)) != len(p.boundaries):
        raise ConfigError("pipeline.boundaries", "must not name a layer twice.", list(p.boundaries))


def parse_device(name: str, key: str) -> tuple[str, int]:
    """Returns (`cpu`|`gpu`|`tpu`, index) for a local device name."""
    match = _DEVICE.match(name)
    if not match:
        raise ConfigError(key, "must be a local device name like /gpu:0 or /cpu:1.", name)
    return match.group(1).lower(), int(match.group(2))


def _check_precision(config: Config) -> None:
    p = config.precision
    scale = p.loss_scale
    if isinstance(scale, str) and scale not in _LOSS_SCALE_WORDS:
        raise ConfigError(
            "precision.loss_scale", "must be dynamic, none or a positive number.", scale
        )
    if isinstance(scale, float) and scale <= 0:
        raise ConfigError("precision.loss_scale", "must be a positive number.", scale)
    if (
        p.policy == PrecisionPolicy.MIXED_FLOAT16
        and scale == "none"
        and not p.allow_unscaled_float16
    ):
        raise ConfigError(
            "precision.loss_scale",
            "cannot be none with policy mixed_float16: small float16 gradients "
            "underflow to zero. Use dynamic, or set precision.allow_unscaled_float16: true.",
            scale,
        )


def _check_train(config: Config) -> None:
    t = config.train
    if t.warmup_epochs and not t.scale_learning_rate:
        raise ConfigError(
            "train.warmup_epochs",
            "ramps the learning rate up to the linearly scaled rate, so it needs "
            "train.scale_learning_rate: true.",
            t.warmup_epochs,
        )
    if t.warmup_epochs > t.epochs:
        raise ConfigError(
            "train.warmup_epochs", f"must not exceed train.epochs ({t.epochs}).", t.warmup_epochs
        )
    if isinstance(t.remat, str) and t.remat not in ("none", "full") or t.remat == ():
        raise ConfigError("train.remat", "must be none, full or a list of layer names and class names.", t.remat)


def _check_callbacks(config: Config) -> None:
    if config.callbacks.input_stalls and config.strategy.spec.processes.coordinated:
        raise ConfigError(
            "callbacks.input_stalls",
            f"is not available with {config.strategy.kind}: the steps and their input run on the "
            "workers, which the coordinator's profiler does not see.",
            True,
        )


def _check_placement(config: Config) -> None:
    p = config.placement
    if p.layers and p.balance_by_memory:
        raise ConfigError("placement.balance_by_memory", "and placement.layers exclude each other.", True)
    for i, pair in enumerate(p.layers):
        name, _, device = pair.partition("=")
        if not name or not device:
            raise ConfigError(f"placement.layers[{i}]", "must be `layer_name=device`, e.g. block1_mlp=/cpu:1.", pair)
        parse_device(device, f"placement.layers[{i}]")


def _check_layout(config: Config) -> None:
    layout = config.layout
    if not config.strategy.takes("layout"):
        return
    if layout.rules and layout.layout_map or not (layout.rules or layout.layout_map or layout.megatron):
        raise ConfigError("layout.rules", "or layout.layout_map, one of the two, or layout.megatron, says how the "
                          f"model is split with strategy.kind={config.strategy.kind}.",
                          [list(r) for r in layout.rules] or "empty")
    mesh = layout.data_devices * layout.model_devices
    if config.strategy.devices and len(config.strategy.devices) < mesh:
        raise ConfigError("strategy.devices", f"must name at least layout.data_devices x layout.model_devices "
                          f"({layout.data_devices} x {layout.model_devices}) devices.", list(config.strategy.devices))


def placement_pairs(config: Config) -> dict[str, str]:
    """`placement.layers` as layer name -> device."""
    return dict(pair.split("=", 1) for pair in config.placement.layers)


def tensor_parallel_size(config: Config, devices: int) -> int:
    """Devices per tensor-parallel group: the configured size, else all (a kind that splits tensors, as
    tensor_parallel) or one (pipeline)."""
    s = config.strategy
    return s.tensor_parallel_size or (devices if s.spec.splits_tensors else 1)


def devices_key(config: Config) -> str:
    """The key that gives this process its devices: `strategy.devices` when set, else `strategy.logical_devices`."""
    return "strategy.devices" if config.strategy.devices else "strategy.logical_devices"


def check_tensor_parallel_devices(config: Config, devices: list[str]) -> None:
    """Raises ConfigError unless `devices` form whole tensor-parallel groups and every placed layer goes to
    the first group."""
    s = config.strategy
    key = devices_key(config)
    size = tensor_parallel_size(config, len(devices))
    if len(devices) % size:
        raise ConfigError(
            "strategy.tensor_parallel_size",
            f"must divide the {len(devices)} devices into whole groups.",
            s.tensor_parallel_size,
        )
    first = devices[:size]
    local = {parse_device(d, key) for d in first}
    for i, device in enumerate(placement_pairs(config).values()):
        if parse_device(device, f"placement.layers[{i}]") not in local:
            raise ConfigError(f"placement.layers[{i}]", f"must place on a device of the first group {first}.", device)
    placed = config.placement.layers or config.placement.balance_by_memory
    if s.shard_optimizer == 3 and placed:
        raise ConfigError("strategy.shard_optimizer", "3 (the weights split) does not apply to a placed model "
                          "(placement) in this version; use 2, or split the model by strategy.tensor_parallel_size.",
                          s.shard_optimizer)


def check_transformer_split(config: Config, size: int) -> None:
    """Raises ConfigError unless the transformer's heads and MLP split over tensor-parallel groups of `size`."""
    m, s = config.model, config.strategy
    for name, value in (("model.heads", m.heads), ("4 x model.width (MLP units)", 4 * m.width)):
        if value % size:
            raise ConfigError(
                "strategy.tensor_parallel_size" if s.tensor_parallel_size else devices_key(config),
                f"must give a number of devices{' per group' if s.tensor_parallel_size else ''} that divides "
                f"{name} ({value}). This config gives {size}.",
                s.tensor_parallel_size or list(s.devices) or s.logical_devices,
            )


def _check_data_parallel(config: Config) -> None:
    s = config.strategy
    if config.horovod.elastic and config.horovod.cycle_time_ms != HorovodConfig.cycle_time_ms:
        raise ConfigError("horovod.cycle_time_ms", "cannot be set with horovod.elastic: Horovod 0.28 crashes "
                          "(segmentation fault) re-forming its ranks when both the fusion threshold and the cycle "
                          "time are fixed, so an elastic job keeps Horovod's default, 1 ms.",
                          config.horovod.cycle_time_ms)
    if s.data_parallel == DataParallel.HOROVOD and config.horovod.elastic:
        raise ConfigError("horovod.elastic", "applies to strategy.kind=horovod only; a pipeline or "
                          "tensor-parallel job over Horovod ranks is not elastic.", True)
    if s.data_parallel == DataParallel.HOROVOD and config.horovod.backward_passes_per_step != 1:
        raise ConfigError("horovod.backward_passes_per_step", "applies to strategy.kind=horovod only; a pipeline "
                          "accumulates over pipeline.num_micro_batches.", config.horovod.backward_passes_per_step)


def _check_cluster(config: Config) -> None:
    c = config.cluster
    kind = config.strategy.launched_as
    resolved = _kinds_where(lambda k: k.processes.resolves_cluster)
    if c.resolver != ClusterResolverKind.CONFIG:
        if not kind.processes.resolves_cluster:
            raise ConfigError(
                "cluster.resolver",
                f"{c.resolver.value} applies to {resolved} (a Horovod job runs "
                "horovodrun over the job's hosts: `tfdist slurm` and `tfdist k8s` write that); "
                f"strategy.kind is {kind.name}.",
                c.resolver.value,
            )
        if c.workers or c.ps or c.chief:
            raise ConfigError("cluster.resolver", f"{c.resolver.value} finds the tasks itself; leave "
                              "cluster.workers, cluster.ps and cluster.chief empty.", c.resolver.value)
    addresses = [(f"cluster.workers[{i}]", a) for i, a in enumerate(c.workers)]
    addresses += [(f"cluster.ps[{i}]", a) for i, a in enumerate(c.ps)]
    addresses += [("cluster.chief", c.chief)] if c.chief else []
    for key, address in addresses:
        check_address(address, key, c.allow_non_loopback)
    # Each role's addresses, as the error messages show them.
    roles = {"workers": list(c.workers), "ps": list(c.ps), "chief": c.chief}
    given = [name for name, value in roles.items() if value]
    if given and not kind.processes.resolves_cluster:
        raise ConfigError(
            f"cluster.{given[0]}",
            f"is only used by the kinds whose processes find each other through it ({resolved}); "
            f"strategy.kind is {kind.name}.",
            roles[given[0]],
        )
    extra = [name for name in ("ps", "chief") if roles[name]]
    if not kind.processes.coordinated and extra:
        raise ConfigError(f"cluster.{extra[0]}", f"only applies to strategy.kind="
                          f"{_kinds_where(lambda k: k.processes.coordinated)}.", roles[extra[0]])
    missing = [name for name in ("chief", "workers", "ps") if not roles[name]]
    if kind.processes.coordinated and given and missing:
        raise ConfigError(
            f"cluster.{missing[0]}",
            "must be set too: a parameter-server cluster names its chief, workers and ps "
            "(or leave all empty to start a local cluster).",
            "empty",
        )
    tasks = {"worker": len(c.workers), "ps": len(c.ps), "chief": 1 if c.chief else 0}[c.task_type.value]
    if (c.workers or c.ps) and c.task_index >= tasks:
        raise ConfigError(
            "cluster.task_index",
            f"must be below the number of {c.task_type.value} tasks ({tasks}).",
            c.task_index,
        )


def check_address(address: str, key: str, allow_non_loopback: bool) -> None:
    """Raises ConfigError unless `address` is host:port on loopback (or allowed off it)."""
    if not isinstance(address, str):
        raise ConfigError(key, "must be a host:port string.", address)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, "must be host:port with a port from 1 to 65535.", address)
    if allow_non_loopback or _resolves_to_loopback_only(host.strip("[]")) or _on_launched_hosts(host):
        return
    raise ConfigError(
        key,
        "must be a loopback address (127.0.0.1, localhost, or a host name that resolves only to "
        "loopback): tf.distribute's gRPC servers have no authentication. Set "
        "cluster.allow_non_loopback: true to use a trusted network.",
        address,
    )


def _on_launched_hosts(host: str) -> bool:
    """Whether `host` is on the private subnet of `tfdist launch --hosts`, whose bridge leads nowhere else."""
    try:
        subnet = ipaddress.ip_network(os.environ.get(HOSTS_SUBNET_ENV, ""))
        return subnet.is_private and ipaddress.ip_address(host) in subnet
    except ValueError:
        return False


def _resolves_to_loopback_only(host: str) -> bool:
    """An IP on loopback, or a name (a one-node cluster's `hostname`) every address of which is."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_devices(config: Config, *, gpus: int) -> None:
    """Raises ConfigError when `strategy.devices` names devices that do not exist.

    Args:
      config: the loaded config.
      gpus: physical GPUs on this machine. Without GPUs, the CPU devices are
        the `strategy.logical_devices` logical ones tfdist creates.
    """
    cpus = 1 if gpus else config.strategy.logical_devices
    for i, name in enumerate(config.strategy.devices):
        kind, index = parse_device(name, f"strategy.devices[{i}]")
        have = {"cpu": cpus, "gpu": gpus, "tpu": 0}[kind]
        if index >= have:
            raise ConfigError(
                f"strategy.devices[{i}]",
                f"names a device that does not exist: this machine has {have} "
                f"{kind.upper()} device(s) for tfdist"
                + ("" if kind != "cpu" or gpus else " (raise strategy.logical_devices for more)")
                + ".",
                name,
            )


def check_batch_split(config: Config, replicas: int) -> None:
    """Raises ConfigError unless the global batch splits evenly over replicas
    (and, for pipelines, each replica's batch over the micro-batches)."""
    batch = config.train.global_batch_size
    if batch % replicas:
        raise ConfigError(
            "train.global_batch_size",
            f"must be divisible by the number of replicas ({replicas}) so every "
            "replica gets the same batch.",
            batch,
        )
    micro = config.pipeline.num_micro_batches
    if config.strategy.takes("pipeline") and (batch // replicas) % micro:
        raise ConfigError(
            "train.global_batch_size",
            f"must be divisible by replicas x pipeline.num_micro_batches ({replicas} x {micro}) "
            "so every micro-batch has the same size.",
            batch,
        )


def check_pipeline_devices(config: Config, devices: list[str]) -> None:
    """Raises ConfigError unless the devices form whole pipeline replicas (of whole
    tensor-parallel groups)."""
    stages = config.pipeline.num_stages
    size = tensor_parallel_size(config, len(devices))
    if len(devices) < stages * size or len(devices) % (stages * size):
        key = devices_key(config)
        per_stage = f" x strategy.tensor_parallel_size ({size})" if size > 1 else ""
        raise ConfigError(
            key,
            f"must give a non-zero multiple of pipeline.num_stages ({stages}){per_stage} devices: each "
            f"pipeline replica takes {stages * size}. This config gives {len(devices)}.",
            list(config.strategy.devices) or config.strategy.logical_devices,
        )
    if size > 1:
        check_tensor_parallel_devices(config, devices[: stages * size])


def _check_sources(config: Config) -> None:
    """`model.name` and the data sources parse; TFRecords have a feature spec with a label and an input."""
    model_source(config.model.name)
    d = config.data
    if d.channels == 2:  # the image modes Keras reads
        raise ConfigError("data.channels", "must be 1 (grayscale), 3 (RGB) or 4 (RGBA).", d.channels)
    kinds = [data_source(d.dataset)[0]]
    if d.validation:
        kinds.append(data_source(d.validation, "data.validation")[0])
        if kinds[-1] == DataSource.BUILTIN:
            raise ConfigError("data.validation", "must be npz:PATH, tfrecord:GLOB, images:DIR or MODULE:FUNCTION; "
                                                 "a built-in dataset holds out data.validation_fraction itself.",
                              d.validation)
    if DataSource.TFRECORD not in kinds:
        if d.features:
            raise ConfigError("data.features", "only applies to a tfrecord:GLOB source.", [f.name for f in d.features])
        return
    names = [f.name for f in d.features]
    if not names:
        raise ConfigError("data.features", "must describe the records of a tfrecord:GLOB source: a list of "
                                            "{name, dtype, shape}, one of them named by data.label.", [])
    for i, feature in enumerate(d.features):
        if not feature.name:
            raise ConfigError(f"data.features[{i}].name", "must be the feature's key in the records.", feature.name)
        if feature.dtype == FeatureDtype.IMAGE and len(feature.shape) != 3:
            raise ConfigError(f"data.features[{i}].shape", "must be [height, width, channels] for an image feature.",
                              list(feature.shape))
        if any(n < 1 for n in feature.shape):
            raise ConfigError(f"data.features[{i}].shape", "must list sizes of at least 1.", list(feature.shape))
    if len(set(names)) != len(names):
        raise ConfigError("data.features", "must not name a feature twice.", names)
    if d.label not in names:
        raise ConfigError("data.label", f"must name one of data.features ({', '.join(names)}).", d.label)
    if len(names) < 2:
        raise ConfigError("data.features", "must hold an input feature besides the label.", names)
