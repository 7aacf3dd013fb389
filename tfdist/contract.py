"""The contract between a strategy and the rest of tfdist: every member it may provide, with its default.

Training, the callbacks, the layers and the Keras hooks ask a strategy only
through `contract(strategy)`, never with `hasattr`. tfdist's strategies mix in
`StrategyContract` and override what they need; TensorFlow's own strategies
(`OneDeviceStrategy`, `TPUStrategy`, a user's `tf.distribute.MirroredStrategy`)
get the defaults, which are what a one-process strategy that needs nothing
special would answer. So a new strategy touches its own module and the
factory that builds it from config, and nothing else.

Example:

    >>> import tensorflow as tf
    >>> contract(tf.distribute.OneDeviceStrategy("/cpu:0")).is_chief
    True
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tfdist._compat.patches import fix_tensorflow_strategies as _fix_tensorflow_strategies
from tfdist._compat.patches import install_patches as _install_patches
from tfdist.errors import ClusterError
from tfdist.memory_limit import guard_optimizer_build

__all__ = ["StrategyContract", "contract", "fix_tensorflow_strategies", "install_patches"]


class StrategyContract:
    """What a tfdist strategy may tell training; mix it in before the TensorFlow strategy class."""

    def __new__(cls, *args, **kwargs):
        # Keras's trainer and optimizer ask the strategy through the contract. In `__new__`, which every
        # construction runs, since some strategies call a TensorFlow base class's `__init__` directly.
        install_patches()
        return super().__new__(cls)

    # --- The step -----------------------------------------------------------------------------
    #: Gradient clipping sees the all-reduced gradient, as on one device (Keras clips each replica's).
    clips_after_all_reduce: bool = False
    #: None leaves the gradients' all-reduce to Keras; a dtype name ("" for the gradients' own) has
    #: tfdist all-reduce them last layer first, in that dtype (`_compat.patches`).
    gradient_all_reduce: Optional[str] = None
    #: None sends gradients to parameter servers as they are; a dtype name ("float16") casts them on the
    #: worker, and the optimizer's update casts them back where the variable lives (`_compat.patches`).
    gradients_sent_as: Optional[str] = None
    #: Batches whose gradients are accumulated locally before one update (Horovod's backward passes).
    accumulation_steps: int = 1
    #: Training steps per call of the train function (parameter servers: per scheduled closure).
    steps_per_execution: int = 1
    #: How variables are cut into shards (parameter servers' `ShardedEmbedding`); None keeps them whole.
    shard_partitioner: Any = None

    @property
    def model_axis(self) -> int:
        """The devices a layout splits a model over (its model axis); 1 for a strategy that splits none."""
        return 1

    @property
    def mesh_groups(self):
        """The `MeshGroups` a layout's split layers reduce over (`tfdist.parallel.spmd`); None elsewhere."""
        return None

    def reduce_gradients(self, grads_and_vars) -> Optional[list]:
        """In a replica: the (gradient, variable) pairs with each gradient reduced over the replicas, or None
        for the all-reduce of every gradient (Keras's, or tfdist's with `gradient_all_reduce`). A layout's
        split variables keep their own replica's."""
        return None

    def keras_hooks(self, model) -> Optional[dict[str, Callable]]:
        """Keras's step functions to replace for `model` (`train_function`, ..., `metrics_result`), or None."""
        return None

    def after_compile(self, model) -> None:
        """Runs after `model.compile` under this strategy, before Keras builds the optimizer (mirrored
        with `shard_optimizer`: split the optimizer's state over the devices)."""

    def after_build(self, model) -> None:
        """Runs once `fit`, `evaluate` or `predict` built the model from its first batch, before its step is
        traced: an error here is one line, not one inside the trace (pipeline: fewer layers than stages)."""

    def before_save(self, model) -> None:
        """Runs before `model.save` or `model.save_weights` opens its file; raises the error of a model
        that cannot be saved that way (Horovod: an optimizer state split over the ranks)."""

    # --- Building the model -------------------------------------------------------------------
    def before_build(self, build_model: Callable) -> None:
        """Runs before the model is built under the scope (tensor parallel: place layers by memory)."""

    def check_model(self, model) -> None:
        """Raises the ConfigError the built model reveals (an unknown `pipeline.boundaries` layer, ...)."""

    # --- Input --------------------------------------------------------------------------------
    #: The chief builds the input every worker reads (parameter servers), so a validation set's size
    #: must be known before it is split.
    input_built_by_chief: bool = False

    def input_workers(self) -> tuple[int, Optional[int]]:
        """(input pipelines of the job, this process's index among them, or None when the index is not
        fixed: the chief feeds every worker, or an elastic job's ranks change)."""
        resolver = self.cluster_resolver  # a cluster of all-reduce workers (MultiWorkerMirroredStrategy), or none
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        chiefs, workers = spec.get("chief", []), spec.get("worker", [])
        if not chiefs + workers:
            return 1, 0
        return len(chiefs + workers), resolver.task_id + (len(chiefs) if resolver.task_type == "worker" else 0)

    # --- The job ------------------------------------------------------------------------------
    @property
    def is_chief(self) -> bool:
        """Whether this process reports and writes checkpoints: in a cluster, the chief, else worker 0."""
        resolver = self.cluster_resolver
        jobs = resolver.cluster_spec().as_dict() if resolver is not None else {}
        if not jobs:
            return True
        if "chief" in jobs:
            return resolver.task_type == "chief"
        return resolver.task_type == "worker" and resolver.task_id == 0

    @property
    def devices(self) -> list[str]:
        """Every device this process trains on (a replica may span several)."""
        return list(self.extended.worker_devices)

    @property
    def multi_process(self) -> bool:
        """Whether the job has other processes that `any_process` must agree with."""
        return False

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` is set in any process of the job; a collective every process calls in step."""
        return flag

    def fit(self, model, fit: Callable, *, epochs: int, callbacks: list):
        """Runs `fit(epochs=..., callbacks=...)`, a partial `model.fit`, and returns its History (elastic
        Horovod runs it under `hvd.elastic.run`)."""
        return fit(epochs=epochs, callbacks=callbacks)

    def wait_for_steps(self) -> None:
        """Returns once every step called so far has finished (parameter servers queue them)."""

    def job_error(self, error) -> Optional[ClusterError]:
        """The one-line ClusterError for a failed step that means a lost peer; None for any other failure."""
        return None

    def job_report(self, model) -> dict[str, Any]:
        """Entries for the summary and `--metrics_out`: the cluster, partition, device groups, placement."""
        return {}

    def process_group(self):
        """This job's processes as a `tfdist.strategies.process_group.ProcessGroup`, for a pipeline or
        tensor-parallel strategy to train its replicas across (`data_parallel`).

        Raises:
          ValueError: the strategy cannot be one (only a data-parallel strategy over processes can).
        """
        name = type(getattr(self, "_strategy", self)).__name__
        raise ValueError(f"`data_parallel` must be `local`, `multi_worker`, `horovod`, or a strategy over processes "
                         f"(tfdist's MultiWorkerMirroredStrategy or HorovodStrategy). Received: a {name}.")


class _TensorFlowStrategy(StrategyContract):
    """One of TensorFlow's own strategies, answering with the contract's defaults."""

    def __new__(cls, strategy):  # a view of a strategy that exists: it installs nothing
        return object.__new__(cls)

    def __init__(self, strategy):
        self._strategy = strategy

    def __getattr__(self, name):  # cluster_resolver, extended, ...: the strategy's own
        return getattr(self._strategy, name)


def install_patches() -> None:
    """Installs tfdist's patches to Keras (`tfdist._compat.patches`), asking strategies through the contract.
    Once: every tfdist strategy calls it when made, and `Checkpoint`, which resumes through them."""
    _install_patches(keras_hooks=lambda strategy, model: contract(strategy).keras_hooks(model),
                     clips_after_all_reduce=lambda strategy: contract(strategy).clips_after_all_reduce,
                     gradient_all_reduce=lambda strategy: contract(strategy).gradient_all_reduce,
                     gradients_sent_as=lambda strategy: contract(strategy).gradients_sent_as,
                     reduce_gradients=lambda strategy, pairs: contract(strategy).reduce_gradients(pairs),
                     after_compile=_after_compile,
                     after_build=lambda strategy, model: contract(strategy).after_build(model),
                     before_save=lambda strategy, model: contract(strategy).before_save(model),
                     is_chief=lambda strategy: contract(strategy).is_chief,
                     multi_process=lambda strategy: contract(strategy).multi_process,
                     any_process=lambda strategy, flag: contract(strategy).any_process(flag),
                     splits_optimizers=lambda strategy: bool(getattr(contract(strategy), "shard_optimizer", 0)),
                     is_tfdists=lambda strategy: isinstance(strategy, StrategyContract))


def fix_tensorflow_strategies() -> None:
    """Has tfdist's fixes of Keras bugs serve TensorFlow's own strategies too (`tf.distribute.MirroredStrategy`,
    `MultiWorkerMirroredStrategy`, ...), for the rest of the process: a custom loop's first step
    (keras-team/keras#19246), gradient accumulation and `use_ema`'s overwrite (keras-team/keras#20582), loss
    scaling's skip decision agreed over the replicas, checkpoint callbacks that write from the chief alone.
    Without this call, making a tfdist strategy changes nothing for code under TensorFlow's own strategies."""
    install_patches()
    _fix_tensorflow_strategies()


def _after_compile(strategy, model) -> None:
    """The strategy's own step after `compile` (a split optimizer's), then the memory check of the optimizer's
    build: a state the process's memory limit cannot hold is one line, not a kill. With the weights split
    (`shard_optimizer` 3) a built model's optimizer is built now: a custom training loop would build it in
    its first step, after its forward pass read the weights whole."""
    answers = contract(strategy)
    answers.after_compile(model)
    optimizer, stage = getattr(model, "optimizer", None), getattr(answers, "shard_optimizer", 0)
    guard_optimizer_build(optimizer, replicas=strategy.num_replicas_in_sync, stage=stage,
                          keep_whole_below=getattr(answers, "keep_whole_below", 0))
    if stage == 3 and model.built and optimizer is not None and not optimizer.built:
        with strategy.scope():
            optimizer.build(model.trainable_variables)


def contract(strategy) -> StrategyContract:
    """The strategy's answers to the contract: its own if it is a tfdist strategy, else the defaults."""
    return strategy if isinstance(strategy, StrategyContract) else _TensorFlowStrategy(strategy)
