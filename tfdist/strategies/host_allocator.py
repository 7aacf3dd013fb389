"""The host's memory allocator as TensorFlow's generator datasets leave it, and as tfdist sets it back.

TensorFlow 2.21 sets glibc's `M_TRIM_THRESHOLD` to 128 KB the first time a
process makes a generator dataset (`tf.data.Dataset.from_generator`; every
Keras `fit` under a `tf.distribute` strategy makes one), so that freed
memory goes back to the system sooner. Setting any of glibc's thresholds
also stops glibc from raising its mmap threshold as large blocks are
freed, so from then on every block of 128 KB or more is mapped on its own
and unmapped when freed: a training step page-faults through every tensor
that large, every step. On a 2-core CPU that made the digits CNN's
training steps about twice as long, under any strategy, and every compiled
function the process ran after it.

`restore_allocator` makes TensorFlow take its step once, early (it does so
once a process), then sets both thresholds where glibc's own adjustment
stops on a 64-bit machine: blocks under 32 MiB come from the heap and are
reused, and the heap gives memory back once 64 MiB of it is free at its top.
`runtime.trim_freed_memory: true` keeps TensorFlow's setting instead (less
resident memory, slower steps).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import tensorflow as tf

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "restore_allocator"]

# glibc's mallopt parameters, and where its dynamic mmap threshold stops on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX);
# it keeps the trim threshold at twice the mmap threshold as it raises it.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


@functools.lru_cache(maxsize=None)  # once a process: TensorFlow changes the allocator once
def restore_allocator() -> bool:
    """Lets TensorFlow's generator datasets set glibc's trim threshold now, then sets the allocator's
    thresholds back to where glibc's own adjustment would take them. Returns whether it could (glibc
    only). Call once TensorFlow's threads and devices are configured: it runs a dataset."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    probe = tf.data.Dataset.from_generator(lambda: iter((0,)), output_signature=tf.TensorSpec((), tf.int32))
    next(iter(probe))  # TensorFlow's change happens here, once
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
