"""The tfdist configuration schema: frozen dataclasses, one per YAML section.

Every field has a default, so an empty section (or a missing one) means "use the
defaults". Numeric bounds live in the field metadata (`bounded`) so that loading
can check them and name the dotted key in the error.

Example:

    >>> from tfdist.config import Config
    >>> Config().strategy.kind
    'mirrored'
    >>> Config().strategy.spec.processes.name
    'one process'
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Optional, Union

from tfdist.config.kinds import DATA_PARALLEL, KINDS, Kind, KindName

__all__ = [
    "AllReduce",
    "BalanceBy",
    "CallbacksConfig",
    "ClusterConfig",
    "Config",
    "DataConfig",
    "Dataset",
    "FeatureConfig",
    "FeatureDtype",
    "ModelConfig",
    "HorovodConfig",
    "HorovodOp",
    "ModelName",
    "PipelineConfig",
    "Optimizer",
    "PrecisionConfig",
    "PrecisionPolicy",
    "RuntimeConfig",
    "Schedule",
    "StrategyConfig",
    "TrainConfig",
    "bounded",
]


def bounded(default, *, low=None, high=None, low_open=False):
    """A dataclass field whose numeric value must lie in [low, high].

    Args:
      default: the field default.
      low: smallest allowed value, or None for no lower bound.
      high: largest allowed value, or None for no upper bound.
      low_open: when True the lower bound itself is not allowed (`> low`).
    """
    return dataclasses.field(
        default=default, metadata={"low": low, "high": high, "low_open": low_open}
    )


class DataParallel(str, enum.Enum):
    LOCAL = "local"
    MULTI_WORKER = "multi_worker"
    HOROVOD = "horovod"


class AllReduce(str, enum.Enum):
    AUTO = "auto"
    NCCL = "nccl"
    HIERARCHICAL_COPY = "hierarchical_copy"
    REDUCTION_TO_ONE_DEVICE = "reduction_to_one_device"
    RING = "ring"


class GradientCompression(str, enum.Enum):
    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"


class PrecisionPolicy(str, enum.Enum):
    FLOAT32 = "float32"
    MIXED_FLOAT16 = "mixed_float16"
    MIXED_BFLOAT16 = "mixed_bfloat16"


class Optimizer(str, enum.Enum):
    SGD = "sgd"
    MOMENTUM = "momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"


class Schedule(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class BalanceBy(str, enum.Enum):
    TIME = "time"
    PARAMS = "params"


class HorovodOp(str, enum.Enum):
    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"


class TaskType(str, enum.Enum):
    CHIEF = "chief"
    WORKER = "worker"
    PS = "ps"


class ClusterResolverKind(str, enum.Enum):
    CONFIG = "config"  # the cluster section, else TF_CONFIG
    SLURM = "slurm"
    KUBERNETES = "kubernetes"  # the pod's role and index, from the manifests `tfdist k8s` writes


class Dataset(str, enum.Enum):
    """The built-in datasets; `data.dataset` also takes sources (`npz:PATH`, ..., see DataConfig)."""

    DIGITS = "digits"
    SYNTHETIC = "synthetic"


class FeatureDtype(str, enum.Enum):
    FLOAT32 = "float32"
    INT64 = "int64"
    IMAGE = "image"  # encoded PNG, JPEG, GIF or BMP bytes, decoded to the feature's shape, scaled to [0, 1]


class ModelName(str, enum.Enum):
    """The built-in models; `model.name` also takes other models (`keras.applications.NAME`, ..., see ModelConfig)."""

    DIGITS_CNN = "digits_cnn"
    MLP = "mlp"
    PIXEL_EMBEDDING = "pixel_embedding"
    TRANSFORMER = "transformer"


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """How the model is distributed.

    Attributes:
      kind: the distribution strategy (what each one is and takes: "Strategy kinds" above).
      devices: explicit device names (`/gpu:0`, `/cpu:1`, ...). Empty means every
        GPU when there are GPUs, else `logical_devices` logical CPU devices.
      logical_devices: how many logical CPU devices to create when the machine
        has no GPU (ignored when it has GPUs).
      all_reduce: the all-reduce implementation. `mirrored` takes auto, nccl,
        hierarchical_copy or reduction_to_one_device; `multi_worker_mirrored`
        takes auto, ring or nccl.
      num_packs: gradient packs for nccl / hierarchical_copy all-reduce.
      bytes_per_pack: collective packing size for multi_worker_mirrored
        (0 lets TensorFlow decide).
      collective_timeout_seconds: a collective that waits longer than this fails
        instead of hanging (multi_worker_mirrored).
      gradient_compression: for multi_worker_mirrored: `fp16` or `bf16` sends
        the gradients at half their bytes, cast before the all-reduce and back
        after it (Horovod jobs set `horovod.fp16_compression`); for
        parameter_server: each worker sends its gradients to the parameter
        servers in that dtype, cast back where the variable lives (the
        variables it reads keep their dtype); `none` sends them as they are.
      tpu: the TPU to connect to (name or grpc:// address, `local` on a TPU VM)
        for strategy.kind=tpu; empty lets TPUClusterResolver look for one.
      tensor_parallel_size: devices that each tensor-parallel layer splits
        over. With tensor_parallel, 0 puts every device in one group, and a
        smaller size makes several groups, one model replica each, trained
        data parallel. With pipeline, the devices of each stage (0: one).
      data_parallel: for pipeline and tensor_parallel: `local` trains this
        process's replicas; `multi_worker` (a cluster from the `cluster`
        section or TF_CONFIG) and `horovod` (the ranks `horovodrun` started)
        run the replicas on the local devices of every process and train all
        of them data parallel, with that backend's collectives.
      shard_optimizer: 1 splits the optimizer's state over the data-parallel
        replicas (ZeRO stage 1): each of N devices keeps the slots of 1/N of
        every variable, with the same weights as unsplit, and checkpoints hold
        the unsplit layout. 2 also reduces each gradient only to its slice's
        owner (a reduce-scatter), so the bytes a step moves are an
        all-reduce's. 3 splits the weights too (ZeRO stage 3, FSDP): each
        device keeps 1/N of every variable of keep_whole_below elements or
        more, a layer's weights are all-gathered for its forward and backward
        passes, and the gradients reduce-scattered (stage 3: strategy.kind
        mirrored, multi_worker_mirrored, horovod, pipeline and layout, not
        with a pipeline's tensor_parallel_size, in this version). Under a
        layout, over the mesh's data axis: each device splits its own shard.
        0 keeps a whole copy on every device. For strategy.kind=mirrored,
        multi_worker_mirrored, horovod, pipeline, tensor_parallel and layout
        (over the replicas of every process with data_parallel).
      keep_whole_below: with shard_optimizer 3, variables of fewer elements
        keep their weights whole on every device (their optimizer state is
        split as at stage 2): biases and norms cost little to keep and much to
        gather one by one. DeepSpeed's stage3_param_persistence_threshold,
        with its default.
      prefetch_weights: with shard_optimizer 3, a layer's weights are
        gathered while the layer before it computes (and, in the backward
        pass, the layer after it), so that on a network the gathers overlap
        compute; false gathers them when the layer's own input is there (one
        layer's weights fewer held at once).
    """

    kind: str = dataclasses.field(default="mirrored", metadata={"choices": KINDS})
    devices: tuple[str, ...] = ()
    logical_devices: int = bounded(4, low=1, high=64)
    all_reduce: AllReduce = AllReduce.AUTO
    num_packs: int = bounded(1, low=1)
    bytes_per_pack: int = bounded(0, low=0)
    collective_timeout_seconds: float = bounded(300.0, low=0, low_open=True)
    gradient_compression: GradientCompression = GradientCompression.NONE
    tpu: str = ""
    tensor_parallel_size: int = bounded(0, low=0, high=64)
    data_parallel: DataParallel = DataParallel.LOCAL
    shard_optimizer: int = bounded(0, low=0, high=3)
    keep_whole_below: int = bounded(100_000, low=0)
    prefetch_weights: bool = True

    def __post_init__(self):
        object.__setattr__(self, "kind", KindName(self.kind))

    @property
    def spec(self) -> Kind:
        """This kind's row of the kinds table (`tfdist.config.kinds`)."""
        return KINDS[self.kind]

    @property
    def launched_as(self) -> Kind:
        """The kind whose processes this job's are: a pipeline or tensor-parallel job with
        `data_parallel` starts like a multi-worker or Horovod one (same tasks, launchers, cluster)."""
        backend = DATA_PARALLEL.get(self.data_parallel.value)
        return KINDS[backend.kind] if backend else self.spec

    def takes(self, name: str) -> bool:
        """Whether this kind, with its data-parallel backend, takes a `strategy.*` option or a section."""
        backend = DATA_PARALLEL.get(self.data_parallel.value)
        own = self.spec.options + self.spec.sections
        return name in own + ((backend.options + backend.sections) if backend else ())


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Model parallelism: whole layers on devices (strategy.kind=tensor_parallel).

    A placed layer's variables are created on its device and its forward and
    backward run there; layers not placed stay on the first device. With
    several groups (strategy.tensor_parallel_size) the devices are the first
    group's, and every group places the same layers at the same positions.

    Attributes:
      layers: `name=device` pairs (`block1_mlp=/cpu:1`).
      balance_by_memory: place every layer: contiguous runs of the model's
        layers, one per device, with parameter bytes balanced.
    """

    layers: tuple[str, ...] = ()
    balance_by_memory: bool = False


def layout_rules(value, key: str) -> tuple:
    """`layout.rules` from YAML: a list of `[regex, [axis or null, ...]]`."""
    from tfdist.errors import ConfigError

    if not isinstance(value, (list, tuple)):
        raise ConfigError(key, "must be a list of [regex, [axis or null, ...]] rules.", value)
    rules = []
    for i, rule in enumerate(value):
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)
                and isinstance(rule[1], (list, tuple)) and all(a in (None, "model", "batch") for a in rule[1])):
            raise ConfigError(f"{key}[{i}]", "must be [regex, [axis or null, ...]] with the axes model, batch or "
                                             "null, e.g. ['.*mlp.*kernel', [null, model]].", rule)
        try:
            re.compile(rule[0])
        except re.error as error:
            raise ConfigError(f"{key}[{i}]", f"is not a regular expression ({error}).", rule[0]) from None
        rules.append((rule[0], tuple(rule[1])))
    return tuple(rules)


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """An unchanged model split by a layout (strategy.kind=layout): Keras's distribution API on TensorFlow.

    The mesh has a data axis `batch` of `data_devices` devices and a model
    axis `model` of `model_devices` devices: the first data_devices x
    model_devices of strategy.devices, every GPU or the logical CPUs,
    data-major. Give `rules` or `layout_map` (not both), or `megatron`, or
    `megatron` with either.

    Attributes:
      model_devices: devices on the mesh's model axis (one copy of the model split over them).
      data_devices: devices on the mesh's data axis (copies of the model trained data parallel).
      rules: `[regex, [axis or null, ...]]` rules: a variable whose whole path
        matches `regex` is split along the axis the list names `model`
        (`['.*mlp_up/kernel', [null, model]]`).
      layout_map: `MODULE:FUNCTION`, called with a `keras.distribution.DeviceMesh`,
        returning a `keras.distribution.LayoutMap` or `ModelParallel` (a
        keras-hub backbone's `get_layout_map`, say); this runs your code.
      megatron: also split what Megatron-LM splits, found in the model: every
        `MultiHeadAttention` on its heads, and every `Dense` whose output only
        another `Dense` consumes, its columns and the other's rows. A rule
        that matches a variable decides it instead.
    """

    model_devices: int = bounded(2, low=1, high=64)
    data_devices: int = bounded(1, low=1, high=64)
    rules: tuple = dataclasses.field(default=(), metadata={"parse": layout_rules})
    layout_map: str = ""
    megatron: bool = False


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism (strategy.kind=pipeline).

    The devices (strategy.devices, or every GPU, or the logical CPUs) form
    pipeline replicas of `num_stages` devices each; data parallel across them.

    Attributes:
      num_stages: stages per pipeline replica (K).
      num_micro_batches: micro-batches each replica's batch is split into (M).
      schedule: `gpipe` (all forwards, then all backwards) or `1f1b`
        (at most K micro-batches of activations alive per stage).
      boundaries: names of the layers that start stages 2..K; empty balances
        the stages automatically.
      balance_by: `time` (measured forward+backward time per layer, parameter
        count when it cannot be measured) or `params`.
      recompute: recompute each stage's activations in the backward pass
        instead of keeping them (less memory, more compute; no Dropout).
    """

    num_stages: int = bounded(2, low=1, high=64)
    num_micro_batches: int = bounded(4, low=1, high=4096)
    schedule: Schedule = Schedule.ONE_F_ONE_B
    boundaries: tuple[str, ...] = ()
    balance_by: BalanceBy = BalanceBy.TIME
    recompute: bool = False


@dataclasses.dataclass(frozen=True)
class ParameterServerConfig:
    """Parameter-server training (strategy.kind=parameter_server).

    Without a cluster (no TF_CONFIG, no cluster.ps), `tfdist train` starts
    `num_workers` workers and `num_ps` parameter servers as local processes on
    loopback and coordinates them; on a real cluster they come from there.

    Attributes:
      num_workers: local workers to start.
      num_ps: local parameter servers to start.
      threads_per_task: intra-op threads of each local task (0: TensorFlow decides).
      restart_workers: restart a local worker that dies (its steps are rescheduled).
      min_shard_bytes: cut embedding tables (`tfdist.layers.ShardedEmbedding`)
        into row shards of at least this many bytes, placed round robin on the
        parameter servers; 0 keeps every table whole. Other Keras variables
        always stay whole.
      max_shards: most shards per table.
      steps_per_execution: training steps per scheduled function.
    """

    num_workers: int = bounded(2, low=1, high=64)
    num_ps: int = bounded(1, low=1, high=64)
    threads_per_task: int = bounded(1, low=0)
    restart_workers: bool = True
    min_shard_bytes: int = bounded(0, low=0)
    max_shards: int = bounded(2, low=1)
    steps_per_execution: int = bounded(1, low=1, high=1000)


@dataclasses.dataclass(frozen=True)
class HorovodConfig:
    """Horovod all-reduce across processes (strategy.kind=horovod).

    One process per device, launched by `horovodrun`; the global batch is
    split evenly across the ranks.

    Attributes:
      op: how gradients are combined: `average` (the mean gradient, the same
        update as one process with the global batch), `sum` (their sum) or
        `adasum` (Maleki et al. 2021; needs `horovodrun --mpi`).
      fp16_compression: send gradients as float16 (half the bytes) and
        restore their dtype after the all-reduce.
      fusion_threshold_bytes: tensors are fused into all-reduce buffers of at
        most this size (Horovod's tensor fusion; 0 turns fusion off).
      cycle_time_ms: how long Horovod waits to collect tensors to fuse.
      backward_passes_per_step: gradients of this many batches are
        accumulated locally before one all-reduce and update.
      timeline: write Horovod's timeline (Chrome trace JSON) here; null for none.
      stall_check_seconds: Horovod's stall inspector reports a rank that has
        not joined a collective within this time.
      stall_shutdown_seconds: a step (or the ranks' agreement between
        steps) running longer than this ends the job with an error (tfdist's step watchdog; Horovod's stall inspector
        shuts down after it too); 0 turns both off. A dead rank fails the
        others at once.
      elastic: train with Horovod's elastic mode (under `horovodrun
        --min-np/--max-np/--host-discovery-script`): when ranks are lost or
        added, the others go on from their last commit instead of failing.
      elastic_commit_batches: commit the training state every this many
        batches (and at every epoch's end); a lost rank costs at most these
        batches of work, never a committed one.
    """

    op: HorovodOp = HorovodOp.AVERAGE
    fp16_compression: bool = False
    fusion_threshold_bytes: int = bounded(64 * 1024 * 1024, low=0)
    cycle_time_ms: float = bounded(1.0, low=0, low_open=True)
    backward_passes_per_step: int = bounded(1, low=1, high=1024)
    timeline: Optional[str] = None
    stall_check_seconds: float = bounded(30.0, low=1)
    stall_shutdown_seconds: float = bounded(600.0, low=0)
    elastic: bool = False
    elastic_commit_batches: int = bounded(1, low=1)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """The Keras dtype policy and loss scaling.

    Attributes:
      policy: float32, mixed_float16 or mixed_bfloat16.
      loss_scale: `dynamic` (Keras LossScaleOptimizer), a positive number (the
        LossScaleOptimizer's initial scale, still adjusted dynamically), or
        `none`. Only used with mixed_float16.
      allow_unscaled_float16: opt-in to mixed_float16 with `loss_scale: none`,
        which underflows small gradients.
    """

    policy: PrecisionPolicy = PrecisionPolicy.FLOAT32
    loss_scale: Union[str, float] = "dynamic"
    allow_unscaled_float16: bool = False


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop.

    Attributes:
      global_batch_size: examples per step summed over all replicas.
      epochs: passes over the training data.
      steps_per_epoch: steps per epoch; null means one pass over the data.
      optimizer: sgd, momentum (SGD with momentum 0.9), adam, adamw or rmsprop.
      learning_rate: the learning rate, tuned for `base_batch_size`.
      scale_learning_rate: apply the linear scaling rule (Goyal et al. 2017):
        learning_rate * global_batch_size / base_batch_size.
      base_batch_size: the batch size `learning_rate` was tuned for.
      warmup_epochs: ramp the learning rate linearly from `learning_rate` to the
        scaled rate over this many epochs (gradual warmup, Goyal et al. 2017).
      seed: seed for weights, data order and dropout.
      verbose: Keras progress output: 0 silent, 1 progress bar, 2 one line/epoch.
      remat: which layers keep only their inputs in a training step and run
        their forward pass again in the backward pass (rematerialization):
        `none`, `full` (every layer that holds weights at the model's top
        level, and inside nested models) or a list of layer names and class
        names
        (`[block0_mlp, MultiHeadAttention]`). Less activation memory for
        about one more forward pass of those layers.
    """

    global_batch_size: int = bounded(64, low=1)
    epochs: int = bounded(20, low=1)
    steps_per_epoch: Optional[int] = bounded(None, low=1)
    optimizer: Optimizer = Optimizer.ADAM
    learning_rate: float = bounded(0.002, low=0, low_open=True)
    scale_learning_rate: bool = False
    base_batch_size: int = bounded(64, low=1)
    warmup_epochs: float = bounded(0.0, low=0)
    seed: int = bounded(1234, low=0)
    verbose: int = bounded(1, low=0, high=2)
    remat: Union[str, tuple[str, ...]] = "none"


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """One feature of the TFRecord examples (`data.dataset: tfrecord:GLOB`).

    Attributes:
      name: the feature's key in each `tf.train.Example`.
      dtype: `float32`, `int64`, or `image` (encoded PNG/JPEG/GIF/BMP bytes,
        decoded to `shape` and scaled to [0, 1]).
      shape: the feature's shape (`[]` for a scalar); for `image`, height,
        width and channels.
    """

    name: str = ""
    dtype: FeatureDtype = FeatureDtype.FLOAT32
    shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The input data.

    Attributes:
      dataset: where the examples come from: `digits` (the UCI handwritten
        8x8 digits that tfdist ships, `tfdist.data.load_digits`), `synthetic`
        (random images and labels, for benchmarks), `npz:PATH` (arrays `x` and `y`, optionally
        `x_val` and `y_val`), `tfrecord:GLOB` (`tf.train.Example` records
        described by `features`), `images:DIR` (one folder of images per
        class), or `MODULE:FUNCTION` (a function of yours returning the
        training `tf.data.Dataset` of unbatched `(x, y)`, or a pair of it and
        the validation one).
      validation: where the validation examples come from, in the same forms
        as `dataset`; empty holds out `validation_fraction` of the training
        source (npz's `x_val`/`y_val` and a function's second dataset come first).
      features: the TFRecord features: each a `name`, `dtype` and `shape`.
      label: the feature (of `features`) that is the label; the others are the input.
      validation_fraction: share of the examples held out for validation.
      synthetic_examples: number of examples of the synthetic dataset.
      image_size: side of the synthetic dataset's square images, and the size
        image folders are resized to.
      channels: channels of the synthetic images and of images read from
        folders (1 grayscale, 3 RGB, 4 RGBA).
      num_classes: classes of the synthetic dataset, of TFRecords and of a
        function's datasets (npz and image folders count their own).
      map_parallelism: examples the preprocessing map works on at once; -1
        lets tf.data tune it (AUTOTUNE), 0 runs it inline, one at a time.
      cache: keep the preprocessed examples in memory after the first pass,
        so the map runs once (turn off for random augmentation).
      prefetch: batches prepared ahead of the step; -1 lets tf.data tune it
        (AUTOTUNE), 0 prepares none ahead.
      shuffle_buffer: examples the training shuffle draws from; 0 is the
        whole training set.
      threads: threads of the input pipeline's own pool, so making batches
        never waits behind the training step's ops; 0 shares TensorFlow's
        inter-op threads with the step.
    """

    dataset: str = Dataset.DIGITS.value
    validation: str = ""
    features: tuple[FeatureConfig, ...] = ()
    label: str = "label"
    validation_fraction: float = bounded(0.2, low=0, high=0.9, low_open=True)
    synthetic_examples: int = bounded(2048, low=1)
    image_size: int = bounded(8, low=4, high=512)
    channels: int = bounded(1, low=1, high=4)
    num_classes: int = bounded(10, low=2)
    map_parallelism: int = bounded(-1, low=-1)
    cache: bool = True
    prefetch: int = bounded(-1, low=-1)
    shuffle_buffer: int = bounded(0, low=0)
    threads: int = bounded(0, low=0)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model to train.

    Attributes:
      name: `digits_cnn` (a small convolutional classifier), `mlp`,
        `pixel_embedding` (each pixel's position and intensity as a token in a
        `tfdist.layers.ShardedEmbedding` table of pixels x 9 rows, the
        vectors concatenated, then a hidden layer of 2 x width), or
        `transformer` (image rows as a sequence; pre-norm blocks of
        `tfdist.layers.ParallelMultiHeadAttention` and `ParallelMLP`, which
        split over the devices of strategy.kind=tensor_parallel); or
        `keras.applications.NAME` (built with `weights=None`, the data's
        input shape and classes), `file:PATH` (a saved `.keras` model,
        compiled again from this config), or `MODULE:FUNCTION` (your function,
        called as `FUNCTION(input_shape=..., num_classes=...)`, returning an
        uncompiled Keras model; this runs your code).
      width: filters of the first conv layer, units of each MLP layer, the
        embedding width, or the transformer's model width.
      depth: number of hidden MLP layers, or transformer blocks.
      heads: attention heads per transformer block (transformer only).
      dropout: dropout rate before the classifier.
    """

    name: str = ModelName.DIGITS_CNN.value
    width: int = bounded(32, low=1)
    depth: int = bounded(2, low=1, high=64)
    heads: int = bounded(4, low=1, high=256)
    dropout: float = bounded(0.1, low=0, high=0.9)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Multi-process cluster description, used when TF_CONFIG is not set.

    tf.distribute's gRPC servers have no authentication, so addresses must be on
    loopback unless `allow_non_loopback` is true.

    Attributes:
      workers: `host:port` of every worker, in task order.
      task_index: this process's index among the tasks of `task_type`.
      chief: `host:port` of the chief (parameter_server: it coordinates).
      ps: `host:port` of every parameter server (parameter_server).
      task_type: this process's role: worker, chief or ps.
      allow_non_loopback: opt in to addresses off 127.0.0.0/8 (unauthenticated
        gRPC: only on a trusted network).
      startup_timeout_seconds: every task must have started within this time,
        or the others fail naming the problem instead of waiting.
      heartbeat_timeout_seconds: a task silent this long counts as dead and
        the others fail instead of hanging.
      resolver: where the cluster comes from: `config` (this section, else
        TF_CONFIG), `slurm` (the tasks of the Slurm job step this process is
        in; see `tfdist slurm`) or `kubernetes` (the pods of the job `tfdist k8s`
        wrote, by their stable hostnames).
      port_base: slurm: the tasks on a node listen on port_base, port_base + 1, ... (keep
        them below the ephemeral range, 32768+ on Linux, where any connection may take a port);
        kubernetes: every pod listens on port_base.
    """

    workers: tuple[str, ...] = ()
    task_index: int = bounded(0, low=0)
    chief: str = ""
    ps: tuple[str, ...] = ()
    task_type: TaskType = TaskType.WORKER
    allow_non_loopback: bool = False
    startup_timeout_seconds: float = bounded(300.0, low=0, low_open=True)
    heartbeat_timeout_seconds: float = bounded(60.0, low=0, low_open=True)
    resolver: ClusterResolverKind = ClusterResolverKind.CONFIG
    port_base: int = bounded(29000, low=1024, high=65000)


@dataclasses.dataclass(frozen=True)
class CallbacksConfig:
    """Callbacks that `tfdist train` adds.

    Attributes:
      throughput_warmup_steps: steps left out of samples/sec and step time
        (tracing, warm-up).
      tensorboard_dir: write TensorBoard logs here; null for none.
      backup_dir: back up the training state here at every epoch end and resume
        from it when the job is run again after a failure (Keras's
        BackupAndRestore; deleted when training completes); null for none.
      device_metrics: sample GPU utilization, memory, power and temperature
        (NVML), TensorFlow's GPU memory and the process's CPU and memory into
        the Keras logs (and TensorBoard with tensorboard_dir).
      device_metrics_interval_seconds: time between device samples.
      input_stalls: measure the share of step time spent waiting for input
        with TensorFlow's profiler, over `input_stalls_steps` steps after
        `throughput_warmup_steps`, and report it with a hint when it is high.
      input_stalls_steps: steps in the measured window.
    """

    throughput_warmup_steps: int = bounded(5, low=0)
    tensorboard_dir: Optional[str] = None
    backup_dir: Optional[str] = None
    device_metrics: bool = False
    device_metrics_interval_seconds: float = bounded(10.0, low=0, low_open=True)
    input_stalls: bool = False
    input_stalls_steps: int = bounded(20, low=1)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of the whole training state, for exact resumes (tfdist.callbacks.Checkpoint).

    Attributes:
      dir: write checkpoints here, and resume from the newest readable one when
        the job starts again; null for none.
      every_steps: save every this many training steps (0: not by steps).
      every_seconds: save when this long has passed since the last save (0: not by time).
        With neither, a checkpoint is saved at every epoch end.
      keep: how many of the newest checkpoints to keep.
      grace_seconds: after SIGTERM, the time to finish the step, save and exit
        (exit code 75) before the process exits without saving. Without `dir`,
        the time to finish the step before exiting 143.
    """

    dir: Optional[str] = None
    every_steps: int = bounded(0, low=0)
    every_seconds: float = bounded(0.0, low=0)
    keep: int = bounded(3, low=1)
    grace_seconds: float = bounded(30.0, low=0, low_open=True)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """TensorFlow runtime settings applied before TensorFlow initialises.

    Attributes:
      intra_op_threads: threads inside one op (0: TensorFlow decides).
      inter_op_threads: ops run at once (0: TensorFlow decides).
      deterministic_ops: TensorFlow's op determinism
        (`tf.config.experimental.enable_op_determinism`): the same inputs give
        the same bits, which a bit-identical resume on a GPU needs.
      trim_freed_memory: keep the host allocator as TensorFlow's generator
        datasets set it (glibc's trim threshold at 128 KB: freed memory goes
        back to the system at once, but every block of 128 KB or more is
        mapped and unmapped each time, which made CPU training steps about
        twice as long). Off: tfdist sets glibc's thresholds back to where its
        own adjustment takes them (reuse blocks under 32 MiB).
    """

    intra_op_threads: int = bounded(0, low=0)
    inter_op_threads: int = bounded(0, low=0)
    deterministic_ops: bool = False
    trim_freed_memory: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole tfdist job.

    Attributes:
      strategy: how the model is distributed.
      pipeline: pipeline parallelism settings (strategy.kind=pipeline).
      parameter_server: parameter-server settings (strategy.kind=parameter_server).
      horovod: Horovod all-reduce settings (strategy.kind=horovod).
      placement: whole layers on devices (strategy.kind=tensor_parallel).
      layout: an unchanged model split by a layout (strategy.kind=layout).
      precision: dtype policy and loss scaling.
      train: the training loop.
      data: the input data.
      model: the model.
      cluster: the multi-process cluster.
      callbacks: callbacks `tfdist train` adds.
      checkpoint: checkpoints for exact resumes.
      runtime: TensorFlow threading.
    """

    strategy: StrategyConfig = StrategyConfig()
    pipeline: PipelineConfig = PipelineConfig()
    parameter_server: ParameterServerConfig = ParameterServerConfig()
    horovod: HorovodConfig = HorovodConfig()
    placement: PlacementConfig = PlacementConfig()
    layout: LayoutConfig = LayoutConfig()
    precision: PrecisionConfig = PrecisionConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    callbacks: CallbacksConfig = CallbacksConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    runtime: RuntimeConfig = RuntimeConfig()
