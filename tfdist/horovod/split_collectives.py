"""How Horovod's ranks share an optimizer state split over them (`tfdist.parallel.optimizer_shards`).

Each rank holds the slice at its rank of every variable, with that slice's
optimizer slots. A step reduces the packed gradients to their owners, each
rank updates its slice, and `hvd.allgather` brings every rank the updated
slices:

- stage 1: `hvd.allreduce` of the packed gradients, of which each rank keeps
  its slice (the bytes of an all-reduce, plus the all-gather's);
- stage 2: `hvd.reducescatter`, so each rank receives only the sum of its
  slice (reduce-scatter + all-gather: an all-reduce's bytes in all);
- stage 3: the weights split too (`tfdist.parallel.weight_shards`): a layer's
  read all-gathers them, their gradients `hvd.reducescatter`.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["HorovodSliceCollectives"]


class HorovodSliceCollectives:
    """The collectives `shard_optimizer_state` splits an optimizer with, across Horovod's ranks (one device
    each).

    Args:
      hvd: the initialised `horovod.tensorflow` module.
      device: this rank's device.
      stage: 1 (all-reduce, keep the slice), 2 (reduce-scatter) or 3 (the weights split too).
      op: `average` or `sum`, as `HorovodAllReduce` combines the gradients
        (Keras scales each rank's loss by 1/size, so `average` sums).
      fp16_compression: send the gradients as float16.
    """

    multi_process = True

    def __init__(self, hvd, device: str, *, stage: int, op: str, fp16_compression: bool):
        if stage not in (1, 2, 3) or op not in ("average", "sum"):
            raise ValueError(f"Horovod splits an optimizer at stage 1, 2 or 3 with op average or sum (Adasum "
                             f"combines whole gradients). Received: stage {stage}, op {op}")
        self.hvd, self.stage = hvd, stage
        self.devices, self.parts, self.ranks = (device,), hvd.size(), (hvd.rank(),)
        self._prescale = 1.0 if op == "average" else float(hvd.size())
        self._compression = hvd.Compression.fp16 if fp16_compression else hvd.Compression.none

    def reduce_scatter(self, d, packed):
        """This rank's slice of the sum over the ranks of `packed` (every rank's slices, in rank order)."""
        wire, context = self._compression.compress(packed * self._prescale if self._prescale != 1 else packed)
        if self.stage >= 2:
            mine = self.hvd.reducescatter(wire, op=self.hvd.Sum)
        else:
            length = packed.shape[0] // self.parts
            mine = self.hvd.allreduce(wire, op=self.hvd.Sum)[self.ranks[0] * length:(self.ranks[0] + 1) * length]
        return self._compression.decompress(mine, context)

    def all_gather(self, d, piece):
        return self.hvd.allgather(piece)

    def gather_pieces(self, pieces):
        """Every rank's piece of a slot, in rank order: a collective, so every rank must save together."""
        (piece,) = pieces
        return self.hvd.allgather(tf.convert_to_tensor(piece))
