"""The patches tfdist makes to Keras: step functions a strategy supplies, resumable epoch iterators, gradient
clipping after the all-reduce, gradient weights by batch share, atomic parameter-server updates, callbacks that
write from the chief alone, optimizer slots built outside a custom loop's traced step, gradient accumulation
under a strategy, tfdist's own code left out of AutoGraph's conversion.

Each is declared in `patches()` (`registry.Patch`: its target, why, the upstream issue, the fingerprint of the
Keras code it was written against) and installed together, once (`install_patches`), where this Keras is that
code. A replacement serves only calls under one of tfdist's strategies (and under TensorFlow's own after
`fix_tensorflow_strategies()`, for the fixes of Keras bugs); every other call runs Keras's own function. How a
patch asks a strategy is given to it (`tfdist.contract` passes the contract's answers), so this module imports
nothing of tfdist's but `_compat`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import weakref
from typing import Callable

from tfdist._compat import registry
from tfdist._compat.keras_internals import backing_value, updates_replaced
from tfdist._compat.registry import Patch

__all__ = ["KerasNotAsWrittenFor", "batches_read", "built_in_a_step", "fix_tensorflow_strategies",
           "forget_step_functions", "gradient_weight", "install_patches", "keras_function", "keras_step_function",
           "parameter_server_writes_in_reverse", "patches", "resume_epoch_iterator", "training_epoch_iterator",
           "weighted_by_batch_share"]

# How the patches ask a strategy, by name (each is described in `install_patches`).
_ASK: dict[str, Callable] = {}
_FIXING_TENSORFLOW = [False]


class KerasNotAsWrittenFor(RuntimeError):
    """A patch tfdist's strategies need does not fit the installed Keras or TensorFlow."""


def install_patches(*, keras_hooks: Callable, clips_after_all_reduce: Callable,
                    gradient_all_reduce: Callable, gradients_sent_as: Callable, reduce_gradients: Callable,
                    after_compile: Callable, after_build: Callable,
                    before_save: Callable, is_chief: Callable, multi_process: Callable, any_process: Callable,
                    splits_optimizers: Callable, is_tfdists: Callable) -> None:
    """Installs every patch that fits this Keras, once; later calls change nothing.

    Args:
      keras_hooks: `(strategy, model)` -> the step functions the strategy supplies for `model`, or None.
      clips_after_all_reduce: `(strategy)` -> whether gradient clipping follows the all-reduce.
      gradient_all_reduce: `(strategy)` -> None for Keras's gradient all-reduce, or the dtype name
        gradients cross the network in ("" for their own), all-reduced last layer first.
      gradients_sent_as: `(strategy)` -> None, or the dtype name gradients cross to the parameter
        servers in: cast on the worker, and back by the optimizer's update where the variable lives.
      reduce_gradients: `(strategy, grads_and_vars)` -> the pairs with their gradients reduced over the
        replicas by the strategy itself, or None for the all-reduce of every gradient.
      after_compile: `(strategy, model)`, run after `model.compile` (a strategy that splits the
        optimizer's state does it then, before Keras builds the optimizer).
      after_build: `(strategy, model)`, run once `fit`, `evaluate` or `predict` built the model from its first
        batch, before its step is traced (a pipeline refuses a model of fewer layers than stages there).
      before_save: `(strategy, model)`, run before `model.save` or `model.save_weights` opens its file;
        it raises when the model cannot be saved that way.
      is_chief: `(strategy)` -> whether this process writes the job's files (the chief, or rank 0).
      multi_process: `(strategy)` -> whether the job has other processes.
      any_process: `(strategy, flag)` -> whether `flag` is set in any process; every process calls it.
      splits_optimizers: `(strategy)` -> whether it splits the state of the optimizer `compile` gets.
      is_tfdists: `(strategy)` -> whether it is one of tfdist's strategies: the patches serve its calls.

    Raises:
      KerasNotAsWrittenFor: a patch does not fit this Keras (another version, or its target's code changed).
    """
    for name, ask in dict(locals()).items():  # the arguments: what the patches ask of a call's strategy
        _ASK.setdefault(name, ask)
    registry.install(patches(), _serves)
    _skip_tfdist_in_autograph()
    reasons = dict.fromkeys(registry.refused().values())  # once each: another version refuses every patch
    if reasons:
        raise KerasNotAsWrittenFor(f"tfdist's patches to Keras do not fit it: {'; '.join(reasons)} "
                                   f"(pip install 'tfdist[cpu]' installs the versions they were written for)")


@functools.cache
def patches() -> tuple[Patch, ...]:
    """Every patch tfdist makes to Keras, in the order they are installed."""
    return (*_trainer_patches(), *_clipping_patches(), *_all_reduce_patches(), *_parameter_server_patches(),
            *_loss_scaling_patches(), *_chief_only_write_patches(), *_saving_patches(), *_optimizer_build_patches(),
            *_accumulation_patches())


def fix_tensorflow_strategies() -> None:
    """The patches marked `fixes_tensorflow` serve TensorFlow's own strategies too, from now on in this process
    (`tfdist.fix_tensorflow_strategies` says which)."""
    _FIXING_TENSORFLOW[0] = True


def _serves(patch: Patch, strategy) -> bool:
    """Whether a call under `strategy` gets `patch`'s replacement rather than Keras's own function."""
    if strategy is None:
        return False
    if _ASK["is_tfdists"](strategy):
        return True
    no_strategy = type(strategy).__name__ == "_DefaultDistributionStrategy"  # Keras alone has none of those bugs
    return patch.fixes_tensorflow and _FIXING_TENSORFLOW[0] and not no_strategy


# The fingerprint (`registry.fingerprint`) of each target's source in Keras 3.15, which its patch was written against.
WRITTEN_AGAINST = {
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer.make_train_function": "a9703da4a49b",
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer.make_test_function": "ad5e9155b929",
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer.make_predict_function": "a772a2efdd90",
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer.get_metrics_result": "89f313bc35c1",
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9",
    "keras.src.trainers.trainer.Trainer.compile": "98ee80c63ae7",
    "keras.src.backend.tensorflow.trainer.TFEpochIterator.__init__": "901af2700297",
    "keras.src.backend.tensorflow.trainer.TFEpochIterator._get_iterator": "b986aa8a9d22",
    "keras.src.backend.tensorflow.trainer.TFEpochIterator.__next__": "bbaac0291856",
    "keras.src.optimizers.base_optimizer.BaseOptimizer._clip_gradients": "152b956e23c9",
    "keras.src.backend.tensorflow.optimizer.TFOptimizer._all_reduce_sum_gradients": "953512efa56c",
    "keras.src.backend.tensorflow.core.Variable.assign_add": "02093eccc2e3",
    "keras.src.backend.tensorflow.core.Variable.assign_sub": "d5f310723e8b",
    "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.check_finite": "b0ce693a4ff0",
    "keras.src.callbacks.backup_and_restore.BackupAndRestore._save_model": "5eb7b53ca13a",
    "keras.src.callbacks.backup_and_restore.BackupAndRestore.on_train_end": "3a3f33285b2c",
    "keras.src.callbacks.model_checkpoint.ModelCheckpoint._save_model": "a9be0a24277f",
    "keras.src.callbacks.callback_list.CallbackList.on_train_begin": "c01ea7a54c55",
    "keras.src.saving.saving_lib.get_attr_skipset": "015ec1e6d451",
    "keras.src.models.model.Model.save": "765eeadff933",
    "keras.src.models.model.Model.save_weights": "939f2c342aa3",
    "keras.src.optimizers.base_optimizer.BaseOptimizer.apply": "43097be63b91",
    "keras.src.backend.tensorflow.optimizer.TFOptimizer._backend_apply_gradients": "48d6e24d5803",
}


def _patch(target: str, make: Callable, why: str, **how) -> Patch:
    return Patch(target, make, why, WRITTEN_AGAINST[target], **how)


def _of_model(model, *args, **kwargs):
    return model.distribute_strategy


def _of_the_context(*args, **kwargs):
    import tensorflow as tf

    return tf.distribute.get_strategy()


def _of_the_callbacks_model(callback, *args, **kwargs):
    return getattr(getattr(callback, "model", None), "distribute_strategy", None)


def keras_function(owner, name: str):
    """Keras's own function under tfdist's patch of `owner.name` (the function itself where none is)."""
    return inspect.unwrap(getattr(owner, name))


def _skip_tfdist_in_autograph() -> None:
    """AutoGraph leaves tfdist's modules as they are, as it leaves TensorFlow's and Keras's.

    A `tf.function` converts every function it calls from a module its rules do not exclude, and a
    fresh process converts each anew: a 2-process pipeline job spent 4.7 of its 6.5 CPU-seconds after
    the imports rewriting tfdist's partitioning and pipelined step, which use Python control flow on
    Python values only. A user's step still converts where TensorFlow converts it (`strategy.run`
    under a tf.function of the user's); Keras's own step functions convert nothing.
    """
    from tensorflow.python.autograph.core import config

    if not any(isinstance(rule, config.DoNotConvert) and rule.matches("tfdist") for rule in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config.DoNotConvert("tfdist"), *config.CONVERSION_RULES)


_TRAINER = "keras.src.backend.tensorflow.trainer.TensorFlowTrainer."
_EPOCH_ITERATOR = "keras.src.backend.tensorflow.trainer.TFEpochIterator."


def _trainer_patches() -> list[Patch]:
    """Lets a strategy supply the step functions Keras 3's TensorFlow trainer runs, and resume an epoch.

    Keras 3 builds `fit`/`evaluate`/`predict` step functions around
    `strategy.run` on the calling process, and offers no way to schedule them
    elsewhere (tf.keras had `_cluster_coordinator`; Keras 3 dropped it). For a
    model whose strategy has `keras_hooks(model)`, the trainer's
    `make_*_function` install the functions that dict names (`train_function`,
    `test_function`, `predict_function`) instead of Keras's, and
    `get_metrics_result` calls its `metrics_result` if it has one. An
    iterator the strategy hands Keras (`experimental_distribute_dataset`) that
    has `on_step_group(first, last, steps_per_epoch)` hears, before each call
    of the train function, which of the epoch's steps that call is for: Keras
    passes it only the iterator, and a last group of `steps_per_execution` may
    be short. Before its first step, Keras builds the model from the first
    batch averaged over the replicas, which fails when that batch does not
    divide over them (3 validation examples on 2 replicas: "AddN must have the
    same size and shape", keras-team/keras#19246), and reads it from a
    distributed iterator it then drops (see `_first_batch`); the build here
    reads the batch before distribution, and only when something is left to
    build. After `compile`, the model's strategy hears of it
    (`after_compile`), before the optimizer is built. The epoch iterator's
    patches change nothing until `resume_epoch_iterator` asks, whatever the
    strategy, but that an epoch's iterator over a tfdist strategy's devices
    starts when a step first reads it (`_StartedOnFirstRead`).
    """

    def hooks_of(model):
        # Made once per compile: `compile` makes a new `_compile_config`, and a
        # recompiled model (new optimizer or loss) needs new step functions.
        compiled_as = getattr(model, "_compile_config", None)
        cached = model.__dict__.get("_tfdist_hooks")
        if cached is None or cached[0] is not compiled_as:
            model.__dict__["_tfdist_hooks"] = (compiled_as, _ASK["keras_hooks"](model.distribute_strategy, model))
        return model.__dict__["_tfdist_hooks"][1]

    def step_function_maker(keras_make):
        attribute = keras_make.__name__.replace("make_", "")

        def make(self, force=False):
            hooks = hooks_of(self)
            if attribute not in (hooks or {}):
                return keras_make(self, force=force)
            setattr(self, attribute, hooks[attribute])
            return getattr(self, attribute)

        return make

    def metrics_result_getter(keras_get):
        def get_metrics_result(self):
            import tensorflow as tf

            hooks = hooks_of(self)
            # In a traced step (Keras's own compute_metrics) the graph reads the metrics itself.
            if "metrics_result" in (hooks or {}) and tf.executing_eagerly():
                return hooks["metrics_result"]()
            return keras_get(self)

        return get_metrics_result

    def build_from_the_undistributed_batch(keras_build):
        def maybe_symbolic_build(self, iterator=None, data_batch=None):
            if iterator is not None and self._distribute_strategy is not None and _needs_a_batch(self):
                data_batch = _first_batch(iterator, self._distribute_strategy)
            keras_build(self, data_batch=data_batch)
            _ASK["after_build"](self.distribute_strategy, self)

        return maybe_symbolic_build

    def strategy_told_of_compile(keras_compile):
        def compile_told(self, *args, **kwargs):
            keras_compile(self, *args, **kwargs)
            _attach_accumulation(self.optimizer)  # before the strategy wraps the optimizer's methods further
            _ASK["after_compile"](self.distribute_strategy, self)

        return compile_told

    def recorded(init):
        def init_recorded(self, *args, **kwargs):
            init(self, *args, **kwargs)
            global _LATEST_EPOCH_ITERATOR
            _LATEST_EPOCH_ITERATOR = weakref.ref(self)

        return init_recorded

    def resumed(get_iterator):
        def get_iterator_resumed(self):
            # Called whenever Keras starts a new iterator over the dataset.
            skip = self.__dict__.pop("_tfdist_skip_batches", 0)
            self.__dict__["_tfdist_batches"] = skip
            if not skip:
                dataset = get_iterator(self)
            else:
                dataset = self.data_adapter.get_tf_dataset().skip(skip)  # global batches: before any sharding
                dataset = self._distribute_strategy.experimental_distribute_dataset(dataset)
            strategy = self._distribute_strategy
            return _StartedOnFirstRead(dataset) if strategy is not None and _ASK["is_tfdists"](strategy) else dataset

        return get_iterator_resumed

    def told(next_group):
        def next_group_told(self):
            first, last, iterator = next_group(self)
            resume_at = self.__dict__.pop("_tfdist_first_step", 0)
            while first < resume_at:  # steps a checkpoint already took: Keras's counter moves, no data is read
                first, last, iterator = next_group(self)
            if isinstance(iterator, _StartedOnFirstRead):
                iterator = iterator.started()
            # An iterator made before the patches were installed has no count yet.
            self.__dict__["_tfdist_batches"] = self.__dict__.get("_tfdist_batches", 0) + last - first + 1
            if hasattr(iterator, "on_step_group"):
                iterator.on_step_group(first, last, self.num_batches)
            return first, last, iterator

        return next_group_told

    step_functions = "a strategy's own step functions (`keras_hooks`), where it has them"
    return [
        *(_patch(_TRAINER + maker, step_function_maker, step_functions, strategy_of=_of_model)
          for maker in ("make_train_function", "make_test_function", "make_predict_function")),
        _patch(_TRAINER + "get_metrics_result", metrics_result_getter,
               "metrics read from a strategy's own step functions (`metrics_result`)", strategy_of=_of_model),
        _patch(_TRAINER + "_maybe_symbolic_build", build_from_the_undistributed_batch,
               "the model built from the first batch before distribution: one that does not divide over the "
               "replicas fails Keras's build", strategy_of=_of_model, fixes_tensorflow=True,
               upstream="keras-team/keras#19246"),
        # On Keras's base class, where `compile_from_config` (model loading) checks it is not overridden.
        _patch("keras.src.trainers.trainer.Trainer.compile", strategy_told_of_compile,
               "the strategy hears of `compile` (it splits the optimizer's state; the memory check of its build)",
               strategy_of=_of_model),
        _patch(_EPOCH_ITERATOR + "__init__", recorded,
               "the epoch iterator `fit` made last is known (`training_epoch_iterator`)"),
        _patch(_EPOCH_ITERATOR + "_get_iterator", resumed,
               "a resumed epoch skips the batches a checkpoint already took; over a tfdist strategy's devices an "
               "epoch's iterator starts on first read"),
        _patch(_EPOCH_ITERATOR + "__next__", told,
               "a resumed epoch starts at the checkpoint's step; a strategy's iterator hears which steps a call "
               "runs (`on_step_group`)"),
    ]


class _StartedOnFirstRead:
    """`iter(dataset)`, made when a step first reads it.

    At the end of every epoch (`steps_per_epoch` unset) Keras starts an iterator for the next one, and at the
    next epoch's start it starts another and drops the first unread: over a strategy's devices each is a
    MultiDeviceIterator, with functions traced for every device and their first batches prefetched. Started
    here on first read, the dropped one costs nothing (the optimizer-shard tests took 16% less CPU).
    """

    def __init__(self, dataset):
        self._dataset, self._iterator = dataset, None

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.started())

    def started(self):
        if self._iterator is None:
            self._iterator = iter(self._dataset)
        return self._iterator


def _needs_a_batch(model) -> bool:
    """Whether Keras's symbolic build still has something to build from a batch's shapes."""
    unbuilt = lambda part: part is not None and not part.built  # noqa: E731
    layers_unbuilt = not all(layer.built for layer in model._flatten_layers())
    return layers_unbuilt or unbuilt(model._compile_metrics) or unbuilt(model._compile_loss)


def _first_batch(epoch_iterator, strategy):
    """The first batch, read from the dataset before distribution where Keras has it.

    Keras reads it from a distributed iterator that it drops at once, at every
    `fit` and `evaluate`. Under load, such a drop crashes TensorFlow natively
    (SIGSEGV in its MultiDeviceIterator's prefetch thread, reading a freed host
    iterator): 7 of 15 processes that each ran 40 fits with validation, three
    side by side on 2 cores, and none of 18 with the build reading no
    distributed iterator. A dataset's own iterator, taken for one batch, is the
    ordinary tf.data case.
    """
    import tensorflow as tf

    dataset = epoch_iterator.data_adapter.get_tf_dataset()
    if isinstance(dataset, tf.data.Dataset):
        return next(iter(dataset.take(1)))
    for _, _, batches in epoch_iterator:  # a dataset the user distributed: its first replica's part
        local = strategy.experimental_local_results
        return tf.nest.map_structure(
            lambda v: local(v)[0] if isinstance(v, tf.distribute.DistributedValues) else v, next(batches))


_LATEST_EPOCH_ITERATOR = None

def training_epoch_iterator():
    """The epoch iterator `fit` made last: in a callback's `on_train_begin`, the one training reads."""
    return _LATEST_EPOCH_ITERATOR() if _LATEST_EPOCH_ITERATOR is not None else None


def resume_epoch_iterator(iterator, *, skip_batches: int, first_step: int) -> None:
    """Has `fit` resume mid-run (the checkpoint callback's half of the handshake; the trainer hooks
    above do the rest): the next iterator over the dataset skips `skip_batches` global batches
    inside tf.data, and the epoch starts at step `first_step` without reading data for the steps
    before it."""
    iterator.__dict__["_tfdist_skip_batches"] = skip_batches
    iterator.__dict__["_tfdist_first_step"] = first_step


def batches_read(iterator) -> int:
    """Global batches read from `iterator`'s current pass over the dataset (skipped ones included)."""
    return iterator.__dict__.get("_tfdist_batches", 0)

def forget_step_functions(model) -> None:
    """Has the next `fit`/`evaluate`/`predict` make `model`'s step functions again (Keras's, or a strategy's
    hooks): they bake in what they were traced with, such as the number of replicas."""
    model.__dict__.pop("_tfdist_hooks", None)
    model.train_function = model.test_function = model.predict_function = None

def keras_step_function(model, attribute: str):
    """Keras's own step function (`train_function`, ...) for `model`, for a hook to wrap."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    keras_function(TensorFlowTrainer, "make_" + attribute)(model, force=True)
    return getattr(model, attribute)

def _clipping_patches() -> list[Patch]:
    """Lets a strategy clip gradients after the all-reduce, as one device would.

    Keras 3 clips (`clipnorm`, `global_clipnorm`, `clipvalue`) each replica's
    gradient before its optimizer all-reduces them, so with two replicas a
    step moved a variable by 0.043 where `lr * clipnorm` is 0.025, and TF's
    own strategies do the same. Keras has no hook between the two. Under a
    strategy whose `clips_after_all_reduce` is true, the gradients are
    all-reduced first, clipped, and divided by the number of replicas, so the
    all-reduce Keras runs next gives the clipped global gradient. It costs one
    more all-reduce per step, only when clipping is on. Other strategies keep
    Keras's behaviour.
    """
    import tensorflow as tf

    def _clip_gradients(keras_clip, self, grads):
        grads = weighted_by_batch_share(grads)
        context = tf.distribute.get_replica_context()
        clipping = self.clipnorm or self.global_clipnorm or self.clipvalue
        if (
            not clipping
            or context is None
            or context.num_replicas_in_sync == 1
            or not _ASK["clips_after_all_reduce"](tf.distribute.get_strategy())
        ):
            return keras_clip(self, grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
        summed = list(grads)
        for i, g in zip(present, reduced):
            summed[i] = g
        replicas = context.num_replicas_in_sync
        return [None if g is None else g / replicas for g in keras_clip(self, summed)]

    return [_patch("keras.src.optimizers.base_optimizer.BaseOptimizer._clip_gradients",
                   lambda keras_clip: functools.partial(_clip_gradients, keras_clip),
                   "gradients weighted by their replica's batch share, and clipped after the all-reduce",
                   strategy_of=_of_the_context)]

def _all_reduce_patches() -> list[Patch]:
    """Lets a strategy all-reduce the gradients last layer first, and compressed.

    Keras 3 all-reduces every gradient in one call, in the order of the
    variables: first layer first. Its gradient is the last the backward pass
    makes, and collectives run in the order they are issued, so no gradient's
    all-reduce can start before the whole backward pass is done. Issued last
    layer first, and packed (`CommunicationOptions.bytes_per_pack`), the first
    packs go out while earlier layers' gradients are still being computed. A
    compression dtype (float16, bfloat16) casts each floating-point gradient
    before the all-reduce and back after it, as Horovod's fp16 compression
    does: half the bytes on the wire. Under parameter servers there is no
    all-reduce: a strategy's `gradients_sent_as` dtype casts the gradients on
    the worker, and Keras's `update_step`, which casts a gradient to its
    variable's dtype first, runs where the variable lives, so only the narrow
    gradient crosses. A strategy may reduce the gradients itself
    (`reduce_gradients`: a layout's split variables keep their own replica's).
    """
    import tensorflow as tf

    def _all_reduce_sum_gradients(keras_all_reduce, self, grads_and_vars):
        context = tf.distribute.get_replica_context()
        strategy = tf.distribute.get_strategy()
        reduced = _ASK["reduce_gradients"](strategy, grads_and_vars) if context is not None else None
        if reduced is not None:
            return reduced
        wire = _ASK["gradient_all_reduce"](strategy) if context is not None else None
        if wire is None:
            sent_as = _ASK["gradients_sent_as"](strategy) if context is not None else None
            if sent_as:
                grads_and_vars = [(_narrowed(g, tf.as_dtype(sent_as)), v) for g, v in grads_and_vars]
            return keras_all_reduce(self, grads_and_vars)
        pairs = list(grads_and_vars)
        backward = [i for i, (g, _) in enumerate(pairs) if g is not None][::-1]
        wire_dtype = tf.as_dtype(wire) if wire else None

        def compressed(g):  # dense gradients only: an all-reduce's sparse rows are all-gathered as they are
            return _narrowed(g, wire_dtype) if wire_dtype and isinstance(g, tf.Tensor) else g

        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [compressed(pairs[i][0]) for i in backward])
        for i, r in zip(backward, reduced):
            gradient, variable = pairs[i]
            pairs[i] = (tf.cast(r, gradient.dtype) if isinstance(r, tf.Tensor) else r, variable)
        return pairs

    return [_patch("keras.src.backend.tensorflow.optimizer.TFOptimizer._all_reduce_sum_gradients",
                   lambda keras_all_reduce: functools.partial(_all_reduce_sum_gradients, keras_all_reduce),
                   "the strategy's own all-reduce of the gradients: last layer first, compressed, or by the strategy",
                   strategy_of=_of_the_context)]


def _loss_scaling_patches() -> list[Patch]:
    """Lets the replicas take loss scaling's step-or-skip decision together, from the whole batch.

    Keras's LossScaleOptimizer checks the gradients for inf and NaN before its
    inner optimizer all-reduces them, so each replica decides from its own part
    of the batch. Under a strategy without merge_call (Horovod) a rank whose
    part overflowed skips the step while the others enter the all-reduce
    without it; under MirroredStrategy the first replica decides for all, and
    another replica's inf reaches every weight. One device decides from the
    whole batch's gradient, which is not finite when any part is not: so the
    replicas' decisions are all-reduced (a count of the parts that overflowed).
    """
    import tensorflow as tf

    def check_finite(keras_check, self, grads):
        finite = keras_check(self, grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        overflowed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(overflowed, 0.0)

    return [_patch("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.check_finite",
                   lambda keras_check: functools.partial(check_finite, keras_check),
                   "loss scaling's step-or-skip decision taken from every replica's gradients, as one device takes it",
                   strategy_of=_of_the_context, fixes_tensorflow=True)]


def _chief_only_write_patches() -> list[Patch]:
    """Keras's BackupAndRestore and ModelCheckpoint write their files from the chief alone in a multi-process job.

    Every process of a job runs its `fit`'s callbacks, and Keras 3's write one path from each (tf.keras's
    knew the workers apart): two processes saving one `.weights.h5` fail on h5py's file lock ("unable to
    lock file"), two writing one `.keras` archive can leave it torn. Every process still restores from the
    backup; saving it, deleting it and ModelCheckpoint's saves are the chief's (a strategy's `is_chief`).
    When every process has such a callback (agreed as `fit` begins), every process waits after each save
    for the chief's to end, so that none reads a file the chief is still writing: Keras's guide restores
    the latest checkpoint as soon as `fit` returns. Horovod's examples give rank 0 alone a ModelCheckpoint;
    then nobody waits.
    """
    from keras.src.callbacks.backup_and_restore import BackupAndRestore
    from keras.src.callbacks.model_checkpoint import ModelCheckpoint

    def on_the_chief(write, *, then_wait: bool):
        def write_on_the_chief(self, *args, **kwargs):
            strategy = self.model.distribute_strategy
            result = write(self, *args, **kwargs) if _ASK["is_chief"](strategy) else None
            if then_wait and getattr(self, "_tfdist_every_process_saves", False):
                _ASK["any_process"](strategy, False)
            return result

        return write_on_the_chief

    def agreeing_who_saves(on_train_begin):
        def on_train_begin_after_agreeing(self, logs=None):
            strategy = self.model.distribute_strategy
            savers = [c for c in self.callbacks if isinstance(c, (BackupAndRestore, ModelCheckpoint))]
            if _ASK["multi_process"](strategy):
                everywhere = not _ASK["any_process"](strategy, not savers)
                for callback in savers:
                    callback._tfdist_every_process_saves = everywhere
            return on_train_begin(self, logs)

        return on_train_begin_after_agreeing

    written = functools.partial(on_the_chief, then_wait=True)
    why = "written by the chief alone in a multi-process job, the other processes waiting for it"
    callbacks = "keras.src.callbacks."
    return [
        _patch(callbacks + "backup_and_restore.BackupAndRestore._save_model", written, why,
               strategy_of=_of_the_callbacks_model, fixes_tensorflow=True),
        _patch(callbacks + "backup_and_restore.BackupAndRestore.on_train_end",
               functools.partial(on_the_chief, then_wait=False), "the backup deleted by the chief alone",
               strategy_of=_of_the_callbacks_model, fixes_tensorflow=True),
        _patch(callbacks + "model_checkpoint.ModelCheckpoint._save_model", written, why,
               strategy_of=_of_the_callbacks_model, fixes_tensorflow=True),
        _patch(callbacks + "callback_list.CallbackList.on_train_begin", agreeing_who_saves,
               "the processes agree whether every one of them has a checkpoint callback (then each waits for the "
               "chief's saves)", strategy_of=_of_the_callbacks_model, fixes_tensorflow=True),
    ]


def _saving_patches() -> list[Patch]:
    """Keras's `.keras` saving builds its bare reference objects once, outside any strategy's scope.

    To know which attributes to skip, Keras's saving builds a bare object of each kind it saves (an
    `Optimizer(1.0)`, with its `iterations` variable), and on every save: its cache is written under one
    key ("saving_attr_skipset_") and read under another ("saving_attr_skiplist_"). Under a multi-worker
    strategy's scope that variable's initial value is broadcast from the chief, so a save on the chief
    alone (ModelCheckpoint's) waits on a collective no other worker joins, and fails when they move on
    ("CollectiveBcastSend ... aborted"). A strategy's scope belongs to its thread: the objects are built
    in a thread of their own, once per kind. Before `model.save` or `save_weights` opens its file, the
    model's strategy may refuse it (`before_save`): an object that cannot give its state (an optimizer
    state split over processes, which one process cannot gather alone) could only raise once the file is
    already truncated, and an earlier save at that path would be lost.
    """
    from concurrent.futures import ThreadPoolExecutor

    skipsets: dict = {}

    def outside_strategies(build):
        def get_attr_skipset(obj_type):
            if obj_type not in skipsets:
                with ThreadPoolExecutor(1) as thread:
                    skipsets[obj_type] = thread.submit(build, obj_type).result()
            return skipsets[obj_type]

        return get_attr_skipset

    def checked(save):
        def save_after_the_check(self, *args, **kwargs):
            _ASK["before_save"](self.distribute_strategy, self)
            return save(self, *args, **kwargs)

        return save_after_the_check

    why = "refused before the file is opened when the model's state cannot be saved that way"
    return [
        _patch("keras.src.saving.saving_lib.get_attr_skipset", outside_strategies,
               "the reference objects saving compares with built once, outside the strategy's scope: a chief's save "
               "alone waited on a collective", strategy_of=_of_the_context, fixes_tensorflow=True),
        _patch("keras.src.models.model.Model.save", checked, why, strategy_of=_of_model),
        _patch("keras.src.models.model.Model.save_weights", checked, why, strategy_of=_of_model),
    ]


_IN_A_STEP = threading.local()  # set while an optimizer first applied in a traced step builds


def built_in_a_step() -> bool:
    """Whether the optimizer building now was first applied inside a traced step (a custom loop's), after
    the step's forward pass: it builds outside the step (`_optimizer_build_patches`)."""
    return getattr(_IN_A_STEP, "on", False)


def _optimizer_build_patches() -> list[Patch]:
    """Builds a Keras optimizer's slots outside the traced step when its first `apply` runs inside one.

    TensorFlow's custom-loop guide calls `optimizer.apply_gradients` inside `strategy.run` inside a
    `tf.function`, and a Keras 3 optimizer creates its slots on that first call. The function then lifts
    the mirrored slots' initializers into a conditional that reads one replica's initial value from
    another's, and the first step fails: "You must feed a value for placeholder tensor
    'cond/else/_1/cond/Placeholder'" (keras-team/keras#19246), under tfdist's strategies and TensorFlow's
    own alike. Here the slots are made once, eagerly (`tf.init_scope`), from the step's cross-replica
    context (`merge_call`), as an optimizer built before the loop would have them. Under a strategy that
    splits the optimizer `compile` gets (`shard_optimizer`), another one is whole, and it says so.
    """
    import tensorflow as tf
    from keras.src import backend

    def apply(keras_apply, self, grads, trainable_variables=None):
        _attach_accumulation(self)  # an optimizer of a custom loop, which no `compile` saw
        context = tf.distribute.get_replica_context()
        if (not self.built and trainable_variables is not None and tf.inside_function()
                and tf.distribute.has_strategy() and context is not None):
            trainable_variables = list(trainable_variables)

            def build(_):
                _IN_A_STEP.on = True
                try:
                    with tf.init_scope(), backend.name_scope(self.name, caller=self):
                        self.build(trainable_variables)
                finally:
                    _IN_A_STEP.on = False

            context.merge_call(build)
            self.built = True
            if _ASK["splits_optimizers"](tf.distribute.get_strategy()) and not updates_replaced(self):
                print(f"tfdist: strategy.shard_optimizer splits the state of the optimizer model.compile gets; "
                      f"{self.name}, first applied in a custom loop, keeps a whole copy on every device",
                      file=sys.stderr, flush=True)
        return keras_apply(self, grads, trainable_variables)

    return [_patch("keras.src.optimizers.base_optimizer.BaseOptimizer.apply",
                   lambda keras_apply: functools.partial(apply, keras_apply),
                   "an optimizer first applied inside a traced step builds its slots outside it",
                   strategy_of=_of_the_context, fixes_tensorflow=True, upstream="keras-team/keras#19246")]


_ACCUMULATION = "keras.src.backend.tensorflow.optimizer.TFOptimizer._backend_apply_gradients"


def _attach_accumulation(optimizer) -> None:
    """Gives an optimizer (or the one a LossScaleOptimizer wraps) that accumulates gradients or overwrites the
    weights with their moving average tfdist's `_backend_apply_gradients` (`_accumulation_patches`), on that
    optimizer alone: every other optimizer, and its class, keep Keras's."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(optimizer, "gradient_accumulation_steps", None) or (
            getattr(optimizer, "use_ema", False) and getattr(optimizer, "ema_overwrite_frequency", None)):
        registry.attach(optimizer, _ACCUMULATION)


def _accumulation_patches() -> list[Patch]:
    """Makes Keras's gradient accumulation (`gradient_accumulation_steps`) work under a tf.distribute strategy.

    Attached to each optimizer that needs it when it is compiled, or first applied, under a strategy the patch
    serves (`_attach_accumulation`), as optax's `MultiSteps` wraps an optimizer: Keras's class is not changed.

    Keras 3 chooses between updating and accumulating with a conditional inside the replica's step,
    and both branches enter the strategy's cross-replica context (`merge_call`), which a conditional
    cannot hold: the first step fails ("Exception encountered when calling Cond.call()",
    keras-team/keras#20582). Here the replica does, every step, what needs no condition: weights its
    gradients by its batch share, averages them with its own accumulated sum (as Keras's accumulators, each
    replica's holds its own gradients), and all-reduces that average (tfdist's all-reduce where the strategy
    asks for it), clipped as on one device. It then enters the
    cross-replica context once, unconditionally, and each variable's update runs the condition per
    device: on every `gradient_accumulation_steps`-th step weight decay and the optimizer's update with
    the average, and the accumulator zeroed; on the others the gradient added to the accumulator. The
    same steps as one device's, on the same global gradients. An optimizer whose state a strategy
    splits (`shard_optimizer`) updates its slices of the averages, on update steps only
    (`keras_internals.replace_accumulated_update`). What an optimizer does per update beside each variable's
    `update_step` is done on update steps too: Nadam's product of its momentum schedule, Muon's decay of the
    variables Adam updates (`keras_internals.step_state_update`, `weight_decay_of`). The weights' moving average
    (`use_ema`) moves every step, and its overwrite of the weights (`ema_overwrite_frequency`, which Keras also puts
    in a conditional that enters the cross-replica context: with or without accumulation) runs as
    `_moving_average_as_keras_does` says.
    """
    import tensorflow as tf
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    from tfdist._compat.keras_internals import accumulated_update, step_state_update, weight_decay_of

    def _backend_apply_gradients(keras_apply, self, grads, trainable_variables):
        context = tf.distribute.get_replica_context()
        if context is None or not tf.distribute.has_strategy():
            return keras_apply(self, grads, trainable_variables)
        if not self.gradient_accumulation_steps:
            if not (self.use_ema and self.ema_overwrite_frequency):
                return keras_apply(self, grads, trainable_variables)
            # Keras's own steps, but its overwrite with the moving average, which fails under a strategy.
            grads = self._clip_gradients(grads)
            self._apply_weight_decay(trainable_variables)
            self._backend_update_step(grads, trainable_variables, self.learning_rate)
            _moving_average_as_keras_does(self)
            return
        split_update = accumulated_update(self)
        step_state = step_state_update(self)
        steps = self.gradient_accumulation_steps
        # A weight split over the replicas (ZeRO 3) has its slice's gradient summed in the backward pass already.
        owed = [i for i, v in enumerate(trainable_variables)
                if not getattr(backing_value(v), "gradient_reduced", False)]
        grads = list(grads)
        for i, g in zip(owed, weighted_by_batch_share([grads[i] for i in owed])):
            grads[i] = g
        # Each replica accumulates its own gradients, as Keras's accumulation does; the averages are all-reduced
        # every step, since a collective cannot wait inside the update step's conditional.
        sums = [self._accumulated_gradients[self._get_variable_index(v)] for v in trainable_variables]
        averages = [(g + total) / steps for g, total in zip(grads, sums)]
        if owed:
            reduced = self._all_reduce_sum_gradients([(averages[i], trainable_variables[i]) for i in owed])
            for i, (average, _) in zip(owed, reduced):
                averages[i] = average
        averages = keras_function(BaseOptimizer, "_clip_gradients")(self, averages)
        is_update_step = (self._iterations + 1) % steps == 0
        learning_rate = self.learning_rate

        def update_or_accumulate(variable, total, gradient, average):
            def update():
                weight_decay = weight_decay_of(self, variable)
                if weight_decay is not None:
                    variable.assign_sub(variable * tf.cast(weight_decay, variable.dtype)
                                        * tf.cast(learning_rate, variable.dtype))
                if split_update is None:
                    self.update_step(average, variable, learning_rate)
                total.assign(tf.zeros_like(total))
                return tf.constant(True)

            def accumulate():
                total.assign_add(tf.cast(gradient, total.dtype))
                return tf.constant(False)

            return tf.cond(is_update_step, update, accumulate)

        def in_cross_replica_context(distribution, grads, averages):
            if step_state is not None:  # before the updates, which read it
                state, next_value = step_state
                distribution.extended.update(
                    backing_value(state), lambda value: tf.cond(is_update_step, lambda: value.assign(
                        next_value(value)).read_value(), value.read_value), group=False)
            for variable, total, gradient, average in zip(trainable_variables, sums, grads, averages):
                distribution.extended.update(variable.value, update_or_accumulate,
                                             args=(total.value, gradient, average), group=False)
            if split_update is not None:  # after the weight decay, which its slices read
                split_update(distribution, averages, trainable_variables, learning_rate, is_update_step)

        tf.__internal__.distribute.interim.maybe_merge_call(in_cross_replica_context, self._distribution_strategy,
                                                            grads, averages)
        if self.use_ema:  # every step, updated or not, as Keras's own accumulation does
            _moving_average_as_keras_does(self)

    return [_patch(_ACCUMULATION, lambda keras_apply: functools.partial(_backend_apply_gradients, keras_apply),
                   "gradient accumulation and the moving average's overwrite under a strategy, with no conditional "
                   "entering the cross-replica context", strategy_of=_of_the_context,
                   fixes_tensorflow=True, upstream="keras-team/keras#20582", attached=True)]


def _moving_average_as_keras_does(optimizer) -> None:
    """The end of Keras's `_backend_apply_gradients`: the weights' moving average (`use_ema`) moves, and every
    `ema_overwrite_frequency` steps the weights take its value. Keras's overwrite enters the cross-replica context
    inside a conditional, which fails under a strategy; here the condition runs per device, inside it."""
    import tensorflow as tf

    variables = optimizer._trainable_variables
    optimizer._update_model_variables_moving_average(variables)
    if not optimizer.ema_overwrite_frequency:
        return
    overwrite_now = (optimizer.iterations + 1) % optimizer.ema_overwrite_frequency == 0

    def overwrite(variable, average):
        return tf.cond(overwrite_now, lambda: variable.assign(average).read_value(), variable.read_value)

    def in_cross_replica_context(distribution):
        for variable, average in zip(variables, optimizer._model_variables_moving_average):
            distribution.extended.update(backing_value(variable), overwrite, args=(average,), group=False)

    tf.__internal__.distribute.interim.maybe_merge_call(in_cross_replica_context, optimizer._distribution_strategy)


def _narrowed(gradient, dtype):
    """A floating-point gradient (dense, or an IndexedSlices' values) cast to the narrower `dtype`."""
    if gradient is None or not gradient.dtype.is_floating or gradient.dtype.size <= dtype.size:
        return gradient
    import tensorflow as tf

    return tf.cast(gradient, dtype)


# Set per replica (MirroredStrategy traces each replica in a thread of its own).
_GRADIENT_WEIGHT = threading.local()


@contextlib.contextmanager
def gradient_weight(weight):
    """Within it, this replica's optimizer multiplies its gradients by `weight` before
    they are all-reduced (and clipped). Needs `install_clipping_after_all_reduce`.

    Keras scales each replica's loss by 1 / replicas, which is right only when
    every replica holds as many examples; there is no hook between the gradient
    and its all-reduce but the optimizer's `_clip_gradients`.
    """
    previous = getattr(_GRADIENT_WEIGHT, "value", None)
    _GRADIENT_WEIGHT.value = weight
    try:
        yield
    finally:
        _GRADIENT_WEIGHT.value = previous


def weighted_by_batch_share(grads: list) -> list:
    """`grads` times the weight `gradient_weight` set for this step (its replica's share of a short batch)."""
    weight = getattr(_GRADIENT_WEIGHT, "value", None)
    return grads if weight is None else [_scaled(g, weight) for g in grads]


def _scaled(gradient, weight):
    import tensorflow as tf

    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(weight, gradient.values.dtype), gradient.indices,
                                gradient.dense_shape)
    return gradient * tf.cast(weight, gradient.dtype)

def _parameter_server_patches() -> list[Patch]:
    """Makes Keras 3's `assign_add`/`assign_sub` atomic for variables on parameter servers.

    Keras 3 updates a variable by read-modify-write (`assign(self + value)`).
    When two workers update the same parameter-server variable at once, one
    worker's update is overwritten and lost (measured: 16 of 192 optimizer
    steps). TensorFlow's own AssignAdd/AssignSub run on the parameter server
    under the variable's lock, as tf.keras used them. Inside
    `parameter_server_writes_in_reverse`, the variables it names are updated
    at its end, in its order. Other variables keep Keras's code.
    """
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    def on_parameter_server(variable) -> bool:
        return not in_stateless_scope() and "/job:ps/" in (getattr(variable._value, "device", "") or "")

    def update(variable, method: str, value):
        value = variable._convert_to_tensor(value, dtype=variable._value.dtype)
        held = getattr(_HELD_WRITES, "writes", None)
        if held is not None and id(variable) in held:
            held[id(variable)].append((method, value))
            return variable
        return getattr(variable._value, method)(value)

    def atomic(keras_update):
        method = keras_update.__name__

        def assign(self, value):
            return update(self, method, value) if on_parameter_server(self) else keras_update(self, value)

        return assign

    why = "an update of a variable on a parameter server is TensorFlow's atomic one, not a read and a write"
    return [_patch("keras.src.backend.tensorflow.core.Variable." + method, atomic, why,
                   strategy_of=_of_the_context) for method in ("assign_add", "assign_sub")]



_HELD_WRITES = threading.local()


@contextlib.contextmanager
def parameter_server_writes_in_reverse(variables: list):
    """Within, `assign_add`/`assign_sub` of `variables` (Keras variables on parameter servers) wait;
    on leaving, they run last variable first, each after the one before has finished.

    A reader that reads `variables` first to last, each after the one before,
    then never sees a later variable older than an earlier one: the steps a
    metric's total counts are counted in its count. Updates that run in the
    order they were written (total, then count) leave a moment where the total
    has a step the count lacks, and TensorFlow orders updates of different
    variables in no way at all: a mid-epoch accuracy read 1.04.
    """
    import tensorflow as tf

    held = {id(variable): [] for variable in variables}
    _HELD_WRITES.writes = held
    try:
        yield
    finally:
        _HELD_WRITES.writes = None
    previous = []
    for variable in reversed(variables):
        for method, value in held[id(variable)]:
            with tf.control_dependencies(previous):
                previous = [getattr(variable._value, method)(value)]

