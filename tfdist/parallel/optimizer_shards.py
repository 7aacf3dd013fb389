"""The optimizer state of a data-parallel job split over its replicas (ZeRO stages 1 and 2, and 3's state).

Under MirroredStrategy or Horovod every replica holds the whole optimizer
state: with Adam, two slots the size of the model on each. `shard_optimizer_state`
gives each of the N replicas the state of 1/N of every variable instead
(Rajbhandari et al. 2020). Each variable is flattened, padded to a multiple of
N and cut into N slices; replica r holds slice r's slots, and a variable for
the slice of the weights that Keras's update writes (filled from the weights
each step, so a change to the weights between steps is seen). A step reduces
the gradients to their slices' owners, each replica applies Keras's own update
for the optimizer to its slice (the `update_step` of a copy of it, built on
that replica's slices), and the updated slices are all-gathered into every
replica's weights. Stage 1 all-reduces the gradients and each replica keeps
its slice of the sum; stage 2 reduce-scatters them, so a step moves an
all-reduce's bytes. The collectives are the strategy's: `DeviceCollectives`
(TensorFlow's collective ops, in one process or across workers),
`tfdist.horovod.split_collectives` across Horovod's ranks.

At stage 3 a large variable's slice is the weights themselves
(`weight_shards`): its gradient arrives from the backward pass already
reduce-scattered, the copy updates the slice in place, and nothing is
gathered after the update; variables under `keep_whole_below` elements are
updated as at stage 2. Clipping then sums a split gradient's square over its
slices, so that it clips as one device does.

Clipping (`clipnorm`, `global_clipnorm`), weight decay with its exclusions and
loss scaling stay in the optimizer's `apply`, on the whole gradients and
weights, so they act as on one device: the tests train the same weights split
and unsplit (SGD with momentum, Adam, AdamW, RMSprop, Adagrad, and
mixed_float16 with loss scaling, on 2 and 4 devices).

Saved, the split state takes the layout of the unsplit optimizer's: `.keras` and
`.weights.h5` files (`save_own_variables`) and `tfdist.Checkpoint` (through
`checkpointed_variables`) hold each slot whole, gathered from the devices'
slices, and cut it into slices again when read. So a checkpoint moves freely
between split and unsplit jobs and between numbers of devices. Across
processes the gather is a collective: every process saves together
(`tfdist.Checkpoint`, or `strategy.save_model` for a Keras file), and a Keras
file written by one is refused.

Example:

    >>> strategy = tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=1)  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = build_model()
    ...     model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")  # split here
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import warnings
import weakref

import keras
import tensorflow as tf

from tfdist import _compat
from tfdist.parallel import recompute, split_variables, weight_shards
from tfdist._compat.tf_distribute import Trackable, numpy_dataset

__all__ = ["ELEMENTWISE_OPTIMIZERS", "DeviceCollectives", "OptimizerShards", "SplitsOptimizerState",
           "checkpointed_variables", "collective_ops_stage", "held_variables", "report_of", "shard_optimizer_state",
           "shards_of"]

# Optimizers whose update of an element depends only on that element's weight, gradient and slots,
# so that updating slices equals updating the whole (each checked in the tests).
ELEMENTWISE_OPTIMIZERS = (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
                          keras.optimizers.RMSprop, keras.optimizers.Adagrad)


def shard_optimizer_state(optimizer: keras.optimizers.Optimizer, strategy: tf.distribute.Strategy,
                          collectives=None, keep_whole_below: int = weight_shards.KEEP_WHOLE_BELOW,
                          model: keras.Model | None = None, prefetch: bool = True) -> OptimizerShards:
    """Splits `optimizer`'s state over `strategy`'s replicas; call before the optimizer is built
    (tfdist's strategies call it at `compile` when given `shard_optimizer`).

    Args:
      optimizer: a Keras optimizer of `ELEMENTWISE_OPTIMIZERS`, or a
        LossScaleOptimizer around one (its inner optimizer is split).
      strategy: the data-parallel strategy it trains under (one replica per
        device).
      collectives: how the replicas reduce-scatter and all-gather the slices
        (see `DeviceCollectives`); default: the in-process strategy's own
        TensorFlow collectives over its devices. Their `stage` 3 splits the weights too.
      keep_whole_below: at stage 3, variables with fewer elements keep their weights whole on every replica
        (their state is split as at stage 2).
      model: at stage 3, the model compiled with `optimizer`: each of its layers that owns split weights
        gathers them in the layers' order and again in its backward pass (`recompute`); without it, where
        they are read, and kept for the backward pass.
      prefetch: at stage 3, a layer's gather is issued while the layer before it computes (FSDP's prefetch);
        False: when the layer's own input (or gradient) is there.

    Returns:
      The `OptimizerShards` that now build and update it.

    Raises:
      ValueError: the optimizer's update does not split element by element,
        it is already built, or it keeps an EMA (not checked yet).
    """
    if optimizer in _SPLIT:  # compiled again
        return _SPLIT[optimizer]
    inner = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    if type(inner) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"`optimizer` must update each element on its own to be split over devices ({names}); "
                         f"{type(inner).__name__} does not or is not checked. Received: {type(inner).__name__}")
    if inner.built:
        raise ValueError("`optimizer` must not be built yet: split its state before `fit` or `build`. "
                         f"Received: a built {type(inner).__name__}")
    if inner.use_ema:
        raise ValueError(f"`optimizer` with use_ema cannot be split over devices yet. Received: {type(inner).__name__}")
    if (collectives is not None and collectives.stage == 3 and inner.gradient_accumulation_steps
            and (inner.clipnorm or inner.global_clipnorm)):
        raise ValueError("`optimizer` with gradient_accumulation_steps cannot clip by norm weights split over devices "
                         "(shard_optimizer 3) in this version: use clipvalue, or stage 2. Received: "
                         f"gradient_accumulation_steps={inner.gradient_accumulation_steps}, clipnorm={inner.clipnorm}, "
                         f"global_clipnorm={inner.global_clipnorm}")
    shards = OptimizerShards(optimizer, inner, strategy, collectives or DeviceCollectives(strategy), keep_whole_below,
                             model, prefetch)
    _SPLIT[optimizer] = shards
    return shards


# Each split optimizer (the one the model is compiled with) and its shards.
_SPLIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shards_of(optimizer) -> OptimizerShards | None:
    """The shards of `optimizer` if its state is split, else None."""
    return _SPLIT.get(optimizer) if optimizer is not None else None


def report_of(optimizer) -> dict:
    """`{"optimizer_state": ...}` for a job's summary when `optimizer`'s state is split (`OptimizerShards.report`),
    else nothing."""
    shards = _SPLIT.get(optimizer)
    return {"optimizer_state": shards.report()} if shards is not None and shards.copies else {}


def held_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables that hold `optimizer`'s state where they live: its own, and for a split one every
    device's slices and their slots (for memory by device)."""
    shards = _SPLIT.get(optimizer)
    own = list(optimizer.variables)
    return own if shards is None else own + [v for copy in shards.copies for v in copy.variables]


def checkpointed_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The TensorFlow variables a checkpoint holds for `optimizer`, in the unsplit optimizer's order
    and shapes: its own variables, or for a split one, each slot as a whole (`WholeSlot`)."""
    own = [variable.value for variable in optimizer.variables]
    shards = _SPLIT.get(optimizer)
    return own + shards.whole_slots if shards is not None else own


class OptimizerShards:
    """Device d's slice of every variable (`slices[d]`) and the copy of the optimizer that holds its
    slots (`copies[d]`), once the optimizer is built; `whole_slots` shows those slots unsplit."""

    def __init__(self, optimizer, inner, strategy, collectives, keep_whole_below=weight_shards.KEEP_WHOLE_BELOW,
                 model=None, prefetch=True):
        self.optimizer, self.inner, self.strategy, self.collectives = optimizer, inner, strategy, collectives
        self.keep_whole_below, self.model, self.prefetch = keep_whole_below, model, prefetch
        self.sharded: set[int] = set()  # indices of the variables whose weights are split too (stage 3)
        self.devices = collectives.devices  # this process's, one slice each
        self.copies: list[keras.optimizers.Optimizer] = []  # one per device
        self.slices: list[list[keras.Variable]] = []  # [device][variable]: that device's slice of the weights
        self.whole_slots: list[WholeSlot] = []  # in the order the unsplit optimizer makes its slots
        self.accumulator_slices: dict[int, list] = {}  # stage 3: a split weight's index -> its accumulator's slices
        self._slots: list[list] = []  # [device]: (slot, index of its slice), in the order the copy made them
        inner.build = self.build
        optimizer.save_own_variables = self.save_own_variables
        optimizer.load_own_variables = self.load_own_variables
        _compat.replace_update_step(inner, self.update)
        _compat.replace_accumulated_update(inner, self.update_accumulated)
        if collectives.stage == 3:
            _compat.replace_clipping(inner, self._clip_as_one_device)

    def build(self, variables):
        if self.copies:  # built: loading a model builds again after its compile did (at stage 3), as Keras's own
            return       # optimizers, a second build changes nothing
        if self.collectives.stage == 3 and _compat.built_in_a_step():
            raise ValueError("An optimizer whose weights are split over the replicas (shard_optimizer 3) must be "
                             "built before the first step reads them: build the model before `compile` (or call "
                             "`optimizer.build(model.trainable_variables)` under the strategy's scope) when "
                             "training in a custom loop.")
        # The model compiled again with another optimizer (keras-hub's tasks compile when built, then with LoRA
        # enabled): what the earlier one split is made whole first, the weights it trained frozen now among them.
        for variable in self.model.variables if self.model is not None else variables:
            if weight_shards.is_sharded(variable):
                weight_shards.unshard_weight(variable)
        # At stage 3 the large variables' slices become the weights themselves (`weight_shards`), before
        # anything keys the variables: a sharded variable's key is its first slice's.
        self.sharded = {i for i, v in enumerate(variables)
                        if self.collectives.stage == 3 and math.prod(v.shape) >= self.keep_whole_below}
        with self.strategy.scope():
            self.slices = [[self._slice_beside(v, d, trainable=i in self.sharded) for i, v in enumerate(variables)]
                           for d in range(len(self.devices))]
        for i in sorted(self.sharded):
            weight_shards.shard_weight(variables[i], self.strategy, self.collectives, [s[i] for s in self.slices])
        if self.sharded and self.model is not None:
            split = {id(variables[i]) for i in self.sharded}
            for layer in [self.model, *_compat.nested_layers(self.model)]:
                if any(id(v) in split for v in _compat.own_trainable_variables(layer)):
                    recompute.recompute(layer, in_order=True, ahead=self.prefetch)
        _compat.build_without_slots(self.inner, variables)
        accumulators = _compat.gradient_accumulators(self.inner)
        for i in sorted(self.sharded) if accumulators else ():  # a split weight's gradients add up in its slices
            with self.strategy.scope():
                self.accumulator_slices[i] = [self._slice_beside(variables[i], d) for d in range(len(self.devices))]
            weight_shards.hold_in(accumulators[i], self.strategy, self.collectives, self.accumulator_slices[i],
                                  gathers=False)
        # The copies take the rate from the optimizer at each update: a schedule need not be rebuilt. They
        # update; the optimizer accumulates (its update runs theirs on its update steps).
        config = {**self.inner.get_config(), "learning_rate": 0.0, "gradient_accumulation_steps": None}
        with self.strategy.scope():
            for d, device in enumerate(self.devices):
                with _single_device_variables(device):  # the copy's step counter; its slots beside the slices
                    copy = type(self.inner).from_config(config)
                    self._slots.append(_build_noting_slots(copy, self.slices[d]))
                self.copies.append(copy)
        self.whole_slots = [WholeSlot([slots[k][0] for slots in self._slots], variables[i], self.collectives)
                            for k, (_, i) in enumerate(self._slots[0])]

    def _slice_beside(self, variable, d, trainable=False):
        """Device d's slice of `variable`, on the device of the variable's copy there (a pipeline stage's
        or a tensor-parallel shard's device: not necessarily the replica's first). A trainable one is the
        weights' own slice (stage 3): a replica's tape watches it."""
        with _single_device_variables(_local(self.strategy, variable.value, d).device):
            return keras.Variable(tf.zeros([self._slice_length(variable)], variable.dtype), trainable=trainable,
                                  name=f"{variable.name}_slice")

    def move_beside(self, moves) -> None:
        """Makes the slices of moved variables, and their slots, again beside them, keeping their values
        (a pipeline places its stages' variables once the model, and maybe the optimizer, is built).

        Args:
          moves: (Keras variable, the devices of its copies, replica by replica) pairs.
        """
        if not self.copies:  # not built yet: the slices will be made beside the variables
            return
        variables = _compat.optimizer_variables(self.inner)
        index = {id(v): i for i, v in enumerate(variables)}
        for d, copy in enumerate(self.copies):
            remade = []
            for variable, devices in moves:
                i = index.get(id(variable))
                if i is not None:
                    beside = [self.slices[d][i]] + [slot for slot, j in self._slots[d] if j == i]
                    beside += [self.accumulator_slices[i][d]] if i in self.accumulator_slices else []
                    remade += [(piece, _single_device_variables(devices[d])) for piece in beside]
            with self.strategy.scope():
                _compat.remake_variables(remade, copy)
        # A split weight is its slices: held again by the remade ones. Holding a slice changes its key (its
        # weight's), so the copies are keyed again too.
        split = [i for i in (index.get(id(v)) for v, _ in moves) if i in self.sharded]
        with contextlib.ExitStack() as keyed:
            keyed.enter_context(_compat.optimizer_keys_kept(self.optimizer, [variables[i] for i in split]))
            for d, copy in enumerate(self.copies):
                keyed.enter_context(_compat.optimizer_keys_kept(copy, [self.slices[d][i] for i in split]))
            for i in split:
                weight_shards.hold_in(variables[i], self.strategy, self.collectives, [s[i] for s in self.slices])
                if i in self.accumulator_slices:
                    weight_shards.hold_in(_compat.gradient_accumulators(self.inner)[i], self.strategy,
                                          self.collectives, self.accumulator_slices[i], gathers=False)

    def update(self, grads, variables, learning_rate):
        """A step, in replica context: the gradients are reduce-scattered (each device receives the sum of
        its slices), each device updates its slices with its copy's own rule, at the optimizer's step
        (which Adam's bias correction reads), and the updated slices are all-gathered into every
        device's weights."""
        _compat.maybe_merge_call(self._update_slices, self.strategy, grads, variables, learning_rate)

    def update_accumulated(self, distribution, averages, variables, learning_rate, only_if):
        """A step of Keras's gradient accumulation (`gradient_accumulation_steps`), in cross-replica context:
        `averages` are the accumulated gradients, all-reduced already, so each device takes its slices of
        them and updates them on update steps (`only_if`) alone. The slices are all-gathered every step,
        unchanged on the others (a collective cannot sit in a condition): stage 1's bytes, whatever the stage."""
        self._update_slices(distribution, averages, variables, learning_rate, reduced=True, only_if=only_if)

    def _update_slices(self, distribution, grads, variables, learning_rate, reduced=False, only_if=None):
        indices = [_compat.variable_index(self.inner, v) for v in variables]
        by_dtype = {}  # one reduce-scatter and one all-gather per dtype
        for position, variable in enumerate(variables):
            by_dtype.setdefault(variable.dtype, []).append(position)
        for d, device in enumerate(self.devices):
            copy, rank = self.copies[d], self.collectives.ranks[d]
            with tf.device(device):
                copy.iterations.assign(_local(distribution, _updates_so_far(self.inner), d))
                for positions in by_dtype.values():
                    whole = [p for p in positions if indices[p] not in self.sharded]
                    if whole:
                        triples = [(grads[p], variables[p], self.slices[d][indices[p]]) for p in whole]
                        self._update_whole(distribution, d, rank, triples, learning_rate, reduced, only_if)
                    for p in (p for p in positions if indices[p] in self.sharded):
                        piece = self.slices[d][indices[p]]  # the weights' slice: its gradient is this slice's sum
                        with tf.device(piece.value.device):
                            _update_if(only_if, copy, _local(distribution, grads[p], d), piece,
                                       _local(distribution, learning_rate, d))

    def _update_whole(self, distribution, d, rank, triples, learning_rate, reduced, only_if):
        """Device d's update of variables every device holds whole, of one dtype ((gradient, variable, slice)
        triples): its slices of their gradients summed, its slices updated, and every slice all-gathered into
        the weights."""
        collectives, parts, copy = self.collectives, self.collectives.parts, self.copies[d]
        pieces = [piece for _, _, piece in triples]
        lengths = [piece.shape[0] for piece in pieces]
        # A gradient that crossed processes may have lost its static shape: its variable's (over a mesh, the
        # replica's own value's).
        local_grads = [tf.ensure_shape(tf.convert_to_tensor(_local(distribution, g, d)), self._own_shape(v))
                       for g, v, _ in triples]
        if reduced:
            mine = [self._slice(g, rank, n) for g, n in zip(local_grads, lengths)]
        else:  # slice e of every gradient, e = 0..parts-1: replica e receives the sum of the e-th part
            local_grads = [weight_shards.contribution(collectives, d, g, split_variables.split_axis(v))
                           for g, (_, v, _) in zip(local_grads, triples)]
            packed = tf.concat([self._slice(g, e, n) for e in range(parts) for g, n in zip(local_grads, lengths)], 0)
            mine = tf.split(collectives.reduce_scatter(d, packed), lengths)
        for (_, variable, piece), grad in zip(triples, mine):
            with tf.device(piece.value.device):  # where its slots are
                piece.assign(self._slice(_local(distribution, variable.value, d), rank, piece.shape[0]))
                _update_if(only_if, copy, grad, piece, _local(distribution, learning_rate, d))
        gathered = tf.reshape(collectives.all_gather(d, tf.concat([piece.value for piece in pieces], 0)), [parts, -1])
        for (_, variable, _), whole in zip(triples, tf.split(gathered, lengths, axis=1)):
            weights = _local(distribution, variable.value, d)
            weights.assign(tf.reshape(tf.reshape(whole, [-1])[:math.prod(weights.shape)], weights.shape))

    def _clip_as_one_device(self, grads, variables):
        """Stage 3's clipping, in a replica: as one device clips the whole batch's gradient. The whole
        variables' gradients are summed over the replicas first (and divided again after, for the sum the
        update makes), the split ones are their slices' sums already, and a split gradient's norm sums its
        slices'. A replica's share of a short batch weighs its whole variables' gradients here (it weighed the
        split ones before their reduce-scatter)."""
        inner, context = self.inner, tf.distribute.get_replica_context()
        if inner.gradient_accumulation_steps:  # accumulated, then weighted, summed and clipped (`patches`)
            return grads
        split = [weight_shards.is_sharded(v) for v in variables]
        grads = [g if split[i] else _compat.weighted_by_batch_share([g])[0] for i, g in enumerate(grads)]
        if not (inner.clipnorm or inner.global_clipnorm or inner.clipvalue):
            return grads
        present = [i for i, g in enumerate(grads) if g is not None]
        whole = [i for i in present if not split[i]]
        for i, g in zip(whole, context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in whole])):
            grads[i] = g
        if inner.clipvalue:
            grads = [None if g is None else tf.clip_by_value(g, -inner.clipvalue, inner.clipvalue) for g in grads]
        else:
            squares = {i: tf.reduce_sum(tf.square(tf.cast(grads[i], tf.float32))) for i in present}
            sliced = [i for i in present if split[i]]
            if sliced:
                summed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack([squares[i] for i in sliced]))
                squares.update({i: summed[k] for k, i in enumerate(sliced)})
            if inner.clipnorm:
                # Keras's arithmetic, in its order: a gradient of rounding noise (a bias before a
                # BatchNormalization) clipped otherwise moves Adam's step.
                limits = {i: tf.maximum(tf.sqrt(squares[i]), inner.clipnorm) for i in present}
                grads = [None if g is None else g * inner.clipnorm / tf.cast(limits[i], g.dtype)
                         for i, g in enumerate(grads)]
            else:  # global_clipnorm, as Keras's `clip_by_global_norm` (a NaN scale when the norm is not finite)
                norm = tf.sqrt(tf.add_n(list(squares.values())))
                limit = inner.global_clipnorm
                scale = limit * tf.minimum(1.0 / norm, 1.0 / limit) + (norm - norm)
                grads = [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
        replicas = context.num_replicas_in_sync
        return [g / replicas if g is not None and not split[i] else g for i, g in enumerate(grads)]

    def _slice_length(self, variable) -> int:
        return -(-math.prod(self._own_shape(variable)) // self.collectives.parts)

    def _own_shape(self, variable) -> tf.TensorShape:
        """A replica's own value's shape: over a mesh, a split variable's shard's."""
        return weight_shards.own_shape(variable.shape, split_variables.split_axis(variable),
                                       getattr(self.collectives, "model", 1))

    def _slice(self, tensor, d, length):
        """Slice d of `tensor` flattened, the last padded with zeros to `length`: only the slice is
        copied, not the whole tensor once per device."""
        piece = tf.reshape(tensor, [-1])[d * length:(d + 1) * length]
        return tf.pad(piece, [[0, length - piece.shape[0]]])

    def report(self) -> dict:
        """How the slots are split: each device's slot bytes, and the unsplit optimizer's (each device's
        whole copy); at stage 3 the trainable weights' too."""
        def nbytes(variable):  # a replica's own
            return math.prod(self._own_shape(variable)) * tf.as_dtype(variable.dtype).size

        report = {"stage": self.collectives.stage, "devices": self.collectives.parts,
                  "slot_bytes_per_device": [sum(nbytes(slot) for slot in copy.variables if len(slot.shape))
                                            for copy in self.copies],
                  "unsplit_slot_bytes": sum(nbytes(slot) for slot in self.whole_slots)}
        if self.collectives.stage == 3:  # and the trainable weights: split ones' slices, the others whole
            variables = _compat.optimizer_variables(self.inner)
            report["weight_bytes_per_device"] = [
                sum(nbytes(slices[i]) if i in self.sharded else nbytes(v) for i, v in enumerate(variables))
                for slices in self.slices]
            report["unsplit_weight_bytes"] = sum(nbytes(v) for v in variables)
        return report

    # Keras's saving (`.keras`, `.weights.h5`): the unsplit optimizer's variables, numbered as it numbers them.
    def check_saveable_by_one_process(self):
        """Raises if the state is split over processes, unless they all save at once (`save_model`):
        gathering the slices is a collective, so a save by one process (the usual rank-0 `model.save`)
        would wait forever for the others."""
        if self.collectives.multi_process and not getattr(_TOGETHER, "on", False):
            raise ValueError("An optimizer whose state is split over processes cannot be saved by one process "
                             "into a Keras file: call `strategy.save_model(model, path)` on every process (the "
                             "chief writes the file), or save with tfdist.Checkpoint, which every process joins. "
                             "Both hold the state whole, for split or unsplit jobs.")

    def save_own_variables(self, store):
        self.check_saveable_by_one_process()  # `keras.saving.save_model` bypasses the strategy's check
        for i, variable in enumerate(self._unsplit_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        variables = self._unsplit_variables()
        if len(store.keys()) != len(variables):
            # As Keras's own optimizer does: a file of another optimizer (or of an unbuilt one) is skipped.
            warnings.warn(f"Skipping variable loading for optimizer '{self.optimizer.name}', because it has "
                          f"{len(variables)} variables whereas the saved optimizer has {len(store.keys())} "
                          "variables." + (" Build it first (it is split over devices)." if not self.copies else ""),
                          stacklevel=2)
            return
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])

    def _unsplit_variables(self):
        return self.optimizer.variables + self.whole_slots


class WholeSlot(Trackable):
    """One slot variable of the unsplit optimizer, made of the devices' slices of it: gathered when
    read or saved, cut into the slices when assigned or restored.

    A tf.train.Checkpoint saves it under a variable's key, so a checkpoint of a
    split job and one of an unsplit job hold the same keys and shapes.
    """

    def __init__(self, pieces, variable, collectives):
        self.pieces, self.collectives = pieces, collectives  # this process's pieces, one per device
        self.shape, self.dtype = tuple(variable.shape), pieces[0].dtype
        self.split_axis = split_variables.split_axis(variable)  # a layout's split, over a mesh

    def read_value(self) -> tf.Tensor:
        return weight_shards.joined([piece.value for piece in self.pieces], self.shape, self.collectives,
                                    self.split_axis)

    def numpy(self):
        return self.read_value().numpy()

    def assign(self, value):
        value = tf.convert_to_tensor(value, self.dtype)
        if tuple(value.shape) != self.shape:
            raise ValueError(f"A slot of shape {self.shape} cannot take a value of shape {tuple(value.shape)}: "
                             "the saved optimizer was built for other variables.")
        return tf.group(weight_shards.assign_slices(self.pieces, value, self.collectives, self.split_axis))

    # How tf.train.Checkpoint saves and restores a trackable that is not a tf.Variable itself.
    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.read_value()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors["VARIABLE_VALUE"])


class SplitsOptimizerState:
    """The strategy-contract members of a data-parallel strategy that takes `shard_optimizer`: the split
    at `compile`, a save by one process refused while the state spans processes, and the split in the
    job's report."""

    shard_optimizer = 0
    keep_whole_below = weight_shards.KEEP_WHOLE_BELOW
    prefetch_weights = True

    def slice_collectives(self):
        """How the replicas share the slices; default: the strategy's TensorFlow collectives."""
        return DeviceCollectives(self, self.shard_optimizer)

    def after_compile(self, model: keras.Model) -> None:
        if self.shard_optimizer:
            shard_optimizer_state(model.optimizer, self, self.slice_collectives(), self.keep_whole_below, model,
                                  self.prefetch_weights)

    def before_save(self, model: keras.Model) -> None:
        shards = shards_of(getattr(model, "optimizer", None))
        if shards is not None:
            shards.check_saveable_by_one_process()

    def save_model(self, model: keras.Model, filepath: str, **kwargs) -> None:
        """`model.save(filepath, **kwargs)` called by every process of the job at once: the chief writes
        the file, the others take part in gathering a split optimizer state and write nothing."""
        with _saving_together(), tempfile.TemporaryDirectory() as scratch:
            model.save(filepath if self.is_chief else os.path.join(scratch, os.path.basename(filepath)), **kwargs)

    def job_report(self, model: keras.Model) -> dict:
        return report_of(model.optimizer)


_TOGETHER = threading.local()  # set while every process saves at once (`save_model`)


@contextlib.contextmanager
def _saving_together():
    _TOGETHER.on = True
    try:
        yield
    finally:
        _TOGETHER.on = False


def collective_ops_stage(shard_optimizer: int) -> int:
    """`shard_optimizer` checked: 0, 1, 2 or 3."""
    if shard_optimizer not in (0, 1, 2, 3):
        raise ValueError(f"`shard_optimizer` must be 0 (a whole copy on every device), 1 (the optimizer state split), "
                         f"2 (the gradients reduce-scattered too) or 3 (the weights split too). "
                         f"Received: {shard_optimizer!r}")
    return shard_optimizer


class DeviceCollectives:
    """How the replicas of a MirroredStrategy or MultiWorkerMirroredStrategy share the slices: the
    strategy's own TensorFlow collectives, over this process's devices and, across workers, theirs.

    Any collectives for `shard_optimizer_state` answer the same: `devices` (this
    process's), `parts` (slices per variable: the replicas in sync), `ranks` (the
    slice each local device holds: its replica id), `multi_process`, and
    `reduce_scatter(d, packed)`, `all_gather(d, piece)` (in a step, for local
    device d) and `gather_pieces(pieces)` (eagerly, on every process at once
    when they are several: every part of a saved slot), and the ZeRO `stage`
    they implement: 1 all-reduces the gradients and keeps each device's slice,
    2 reduce-scatters them.
    """

    def __init__(self, strategy, stage: int = 1):
        self.strategy, self.stage = strategy, stage
        self.devices = tuple(strategy.extended.worker_devices)
        self.parts = strategy.num_replicas_in_sync
        self.ranks = tuple(strategy.experimental_local_results(
            strategy.experimental_distribute_values_from_function(lambda context: context.replica_id_in_sync_group)))
        self.multi_process = self.parts > len(self.devices)
        self._gathers: dict = {}  # (slice shape, dtype) -> every process's slices gathered (`gather_pieces`)

    def reduce_scatter(self, d, packed):
        return _compat.slice_of_sum(_compat.collective_launchers(self.strategy)[d], packed, self.ranks[d], self.stage)

    def all_gather(self, d, piece):
        return _compat.all_gather(_compat.collective_launchers(self.strategy)[d], piece)

    def gather_pieces(self, pieces):
        if not self.multi_process:
            return tf.concat(pieces, axis=0)
        # One traced gather per slice shape, reused: the strategy's own `gather` traces anew at every call, which
        # made reading a many-variable model whole (get_weights, a checkpoint) take seconds.
        key = (tuple(pieces[0].shape), pieces[0].dtype)
        if key not in self._gathers:
            self._gathers[key] = tf.function(lambda *local: [self.all_gather(d, p) for d, p in enumerate(local)][0])
        return self._gathers[key](*pieces)


def _build_noting_slots(copy, slices) -> list:
    """Builds `copy` on `slices`, with its slots made on the device in scope; returns each slot with the
    index of the slice it was made for, in the order they were made (the unsplit optimizer's order)."""
    _compat.make_slots_where_created(copy)
    make_slot, made = copy.add_variable_from_reference, []
    index = {id(piece): i for i, piece in enumerate(slices)}

    def noted(reference, *args, **kwargs):
        with _single_device_variables(reference.value.device):
            slot = make_slot(reference, *args, **kwargs)
        made.append((slot, index[id(reference)]))
        return slot

    copy.add_variable_from_reference = noted
    copy.build(slices)
    return made


def _updates_so_far(optimizer):
    """The step an optimizer's update reads (Adam's bias correction): its `iterations` variable, or with
    gradient accumulation the updates Keras counts from it (a tensor)."""
    steps = optimizer.iterations
    return getattr(steps, "value", steps)


def _update_if(condition, copy, grad, piece, learning_rate) -> None:
    """`copy.update_step(grad, piece, learning_rate)`, only where `condition` holds when one is given."""
    if condition is None:
        copy.update_step(grad, piece, learning_rate)
        return

    def update():
        copy.update_step(grad, piece, learning_rate)
        return tf.constant(True)

    tf.cond(condition, update, lambda: tf.constant(False))


def _local(distribution, value, d):
    """Device d's part of a per-replica or mirrored value; a value the replicas share, as it is."""
    parts = distribution.experimental_local_results(value)
    return parts[d] if len(parts) > 1 else parts[0]


@contextlib.contextmanager
def _single_device_variables(device):
    """Variables created inside a strategy's scope are plain variables on `device`, not mirrored ones:
    MirroredStrategy makes one for a `colocate_with` naming a single device. An inner scope's device
    stands (its creator runs first)."""

    def on_device(next_creator, **kwargs):
        if kwargs.get("colocate_with") is None:
            kwargs["colocate_with"] = numpy_dataset.SingleDevice(device)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(on_device):
        yield
