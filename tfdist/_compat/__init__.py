"""The only place tfdist reaches into Keras or TensorFlow internals, or probes optional packages.

By concern:
- `versions`: the versions every function here was checked against
  (TensorFlow 2.21, Keras 3.15); importing this package warns once outside them;
- `patches`: what tfdist changes in Keras, installed together and once
  (`tfdist.contract.install_patches`), serving calls under tfdist's strategies only;
- `registry`: each patch's target, reason, upstream issue and the fingerprint of the Keras code it was
  written against; a patch whose target differs is not installed;
- `keras_internals` and `tensorflow_internals`: private state tfdist reads;
- `tf_distribute`: the private TensorFlow classes the strategies extend;
- `optional`: Horovod, NVML and the profiler's protobuf, on first use.

Each function names the public behaviour it needs and why no public API gives it.
"""

from tfdist._compat.keras_internals import (
    attention_projections,
    backing_value,
    build_for_training,
    build_without_slots,
    gradient_accumulators,
    graph_nodes,
    has_layer_graph,
    keras_call_state,
    keras_global_seed_state,
    keras_reduce_per_replica,
    layout_map_of,
    loss_tracker,
    make_slots_where_created,
    nested_layers,
    optimizer_variables,
    own_trainable_variables,
    replace_accumulated_update,
    replace_clipping,
    replace_update_step,
    replace_variable_value,
    start_at_epoch,
    stored_kernel,
    variable_index,
)
from tfdist._compat.optional import horovod, nvml, xspace
from tfdist._compat.patches import (
    batches_read,
    built_in_a_step,
    forget_step_functions,
    gradient_weight,
    keras_step_function,
    parameter_server_writes_in_reverse,
    resume_epoch_iterator,
    training_epoch_iterator,
    weighted_by_batch_share,
)
from tfdist._compat.tensorflow_internals import (
    all_gather,
    auto_shard,
    broadcast,
    collective_keys,
    collective_launchers,
    configure_coordination_service,
    gradients_recorded,
    graph_functions,
    maybe_merge_call,
    merge_calls_in_place,
    needs_gradient,
    op_flops,
    partition_graphs,
    peer_answers,
    optimizer_keys_kept,
    remake_variables,
    replica_index,
    scheduled_by_coordinator,
    slice_of_sum,
    worker_place,
)
from tfdist._compat.versions import TESTED_VERSIONS, check_versions

__all__ = [
    "TESTED_VERSIONS",
    "all_gather",
    "attention_projections",
    "backing_value",
    "auto_shard",
    "batches_read",
    "broadcast",
    "build_for_training",
    "built_in_a_step",
    "build_without_slots",
    "check_versions",
    "collective_keys",
    "collective_launchers",
    "configure_coordination_service",
    "forget_step_functions",
    "gradient_weight",
    "gradients_recorded",
    "gradient_accumulators",
    "graph_functions",
    "graph_nodes",
    "horovod",
    "keras_call_state",
    "keras_global_seed_state",
    "keras_reduce_per_replica",
    "keras_step_function",
    "layout_map_of",
    "loss_tracker",
    "make_slots_where_created",
    "maybe_merge_call",
    "merge_calls_in_place",
    "needs_gradient",
    "nested_layers",
    "nvml",
    "op_flops",
    "optimizer_variables",
    "own_trainable_variables",
    "parameter_server_writes_in_reverse",
    "partition_graphs",
    "peer_answers",
    "optimizer_keys_kept",
    "remake_variables",
    "replica_index",
    "replace_accumulated_update",
    "replace_clipping",
    "replace_update_step",
    "replace_variable_value",
    "resume_epoch_iterator",
    "scheduled_by_coordinator",
    "slice_of_sum",
    "start_at_epoch",
    "training_epoch_iterator",
    "variable_index",
    "weighted_by_batch_share",
    "worker_place",
    "xspace",
]
