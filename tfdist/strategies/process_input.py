"""Input for a strategy whose replicas span processes: each process is one input pipeline.

TensorFlow's MirroredStrategy feeds all of its replicas from one dataset in one
process. When each process of a job runs some of the replicas (Horovod's ranks,
or the replica groups of a multi-process pipeline or tensor-parallel job), each
process must keep its own share of every global batch, as MultiWorkerMirroredStrategy
does: `PerProcessInput` hands TensorFlow's distributed-dataset builders an
`InputContext` naming this process among the others.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf
from tfdist._compat.tf_distribute import input_util

__all__ = ["PerProcessInput"]


class PerProcessInput:
    """Mixed into a MirroredExtended ahead of it: datasets sharded by this process's place among the processes.

    Subclasses give `_process_place()`: (this process's index, the number of processes), or None when the job is
    one process (then MirroredStrategy's own input)."""

    def _process_place(self) -> Optional[tuple[int, int]]:
        raise NotImplementedError

    def _input_context(self) -> tf.distribute.InputContext:
        index, processes = self._process_place() or (0, 1)
        return tf.distribute.InputContext(num_input_pipelines=processes, input_pipeline_id=index,
                                          num_replicas_in_sync=self._num_replicas_in_sync)

    def _experimental_distribute_dataset(self, dataset, options):
        if self._process_place() is None:
            return super()._experimental_distribute_dataset(dataset, options)
        return input_util.get_distributed_dataset(
            dataset, self._input_workers_with_options(options), self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync, input_context=self._input_context(), options=options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if self._process_place() is None:
            return super()._distribute_datasets_from_function(dataset_fn, options)
        return input_util.get_distributed_datasets_from_function(
            dataset_fn=dataset_fn, input_workers=self._input_workers_with_options(options),
            input_contexts=[self._input_context()], strategy=self._container_strategy(), options=options)
