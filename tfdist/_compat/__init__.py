"""The only place tfdist reaches into Keras or TensorFlow internals, or probes optional packages.

By concern:
- `versions`: the versions every function here was checked against
  (TensorFlow 2.21, Keras 3.15); importing this package warns once outside them;
- `patches`: what tfdist changes in Keras, installed together and once
  (`tfdist.strategies.base.install_patches`);
- `keras_internals` and `tensorflow_internals`: private state tfdist reads;
- `tf_distribute`: the private TensorFlow classes the strategies extend;
- `optional`: Horovod, NVML and the profiler's protobuf, on first use.

Each function names the public behaviour it needs and why no public API gives it.
"""

from tfdist._compat.keras_internals import (
    build_for_training,
    build_without_slots,
    graph_nodes,
    keras_global_seed_state,
    keras_reduce_per_replica,
    loss_tracker,
    make_slots_where_created,
    replace_accumulated_update,
    replace_update_step,
)
from tfdist._compat.optional import horovod, nvml, xspace
from tfdist._compat.patches import (
    batches_read,
    forget_step_functions,
    gradient_weight,
    keras_step_function,
    parameter_server_writes_in_reverse,
    resume_epoch_iterator,
    training_epoch_iterator,
)
from tfdist._compat.tensorflow_internals import (
    all_gather,
    auto_shard,
    collective_launchers,
    configure_coordination_service,
    merge_calls_in_place,
    needs_gradient,
    partition_graphs,
    peer_answers,
    remake_variables,
    scheduled_by_coordinator,
    slice_of_sum,
)
from tfdist._compat.versions import TESTED_VERSIONS, check_versions

__all__ = [
    "TESTED_VERSIONS",
    "all_gather",
    "auto_shard",
    "batches_read",
    "build_for_training",
    "build_without_slots",
    "check_versions",
    "collective_launchers",
    "configure_coordination_service",
    "merge_calls_in_place",
    "forget_step_functions",
    "gradient_weight",
    "graph_nodes",
    "horovod",
    "keras_global_seed_state",
    "keras_reduce_per_replica",
    "keras_step_function",
    "loss_tracker",
    "make_slots_where_created",
    "needs_gradient",
    "nvml",
    "parameter_server_writes_in_reverse",
    "partition_graphs",
    "peer_answers",
    "remake_variables",
    "scheduled_by_coordinator",
    "slice_of_sum",
    "replace_accumulated_update",
    "replace_update_step",
    "resume_epoch_iterator",
    "training_epoch_iterator",
    "xspace",
]
